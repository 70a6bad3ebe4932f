"""AUTH with an ACL user, TLS, and the password: used, never printed or logged."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from offload_rig import chain
from shared_tier_rig import admit, compute_and_store, replica
from valkey_server import needs_server, server_in, tls_files

from kvferry.adapters.shared_tier import SharedTierSettings

pytestmark = needs_server()
SECRET = "s3cret-Pa55word"
USERS = f"user default off\nuser kv on >{SECRET} ~kvferry/* +exists +get +set +hello +auth +ping\n"
"""The least an engine needs (docs/shared-tier.md, Security)."""


def acl(directory: Path) -> list[str]:
    """Return the server flags of an ACL file: the default user off, user `kv` on."""
    path = directory / "users.acl"
    path.write_text(USERS)
    return ["--aclfile", str(path)]


PROMPT = chain(8, family=0, shared=0)


def test_an_acl_user_with_its_password_shares_prefixes(tmp_path: Path) -> None:
    for server in server_in(tmp_path, acl(tmp_path)):
        a, tier_a = replica(server.url, username="kv", password=SECRET)
        compute_and_store(a, tier_a, "r1", PROMPT)
        b, tier_b = replica(f"redis://kv:{SECRET}@127.0.0.1:{server.port}")
        assert admit(b, tier_b, b.arrive("r1", PROMPT)) is not None
        assert tier_b.counters().promoted == 6


def test_a_wrong_password_makes_requests_recompute_without_showing_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for server in server_in(tmp_path, acl(tmp_path)):
        b, tier_b = replica(server.url, username="kv", password="wrong-" + SECRET)
        assert admit(b, tier_b, b.arrive("r1", PROMPT)) is None
        counters = tier_b.counters()
        assert counters.errors == 1
        assert SECRET not in caplog.text
        assert SECRET not in repr(tier_b.settings)


def test_the_settings_never_print_the_password() -> None:
    in_field = SharedTierSettings(url="redis://h:1", model="m", password=SECRET)
    in_url = SharedTierSettings(url=f"redis://kv:{SECRET}@h:1", model="m")
    for settings in (in_field, in_url):
        assert SECRET not in repr(settings)
        assert SECRET not in str(settings)
        assert SECRET not in settings.safe_url
    assert in_url.safe_url == "redis://kv:***@h:1"
    assert in_url.credentials() == ("kv", SECRET)


def test_a_url_refused_by_the_settings_does_not_show_its_password() -> None:
    with pytest.raises(ValueError) as refused:
        SharedTierSettings(url=f"http://kv:{SECRET}@h:1", model="m")
    assert SECRET not in str(refused.value)


def test_the_demo_never_prints_the_password(tmp_path: Path) -> None:
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET + "\n")
    for server in server_in(tmp_path, acl(tmp_path)):
        for url, extra in (
            (
                f"redis://kv@127.0.0.1:{server.port}",
                ["--shared-tier-password-file", str(secret_file)],
            ),
            (f"redis://kv:{SECRET}@127.0.0.1:{server.port}", []),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "kvferry.adapters.cli", "demo", "--requests", "8",
                 "--shared-tier", url, "--replicas", "2", "--no-progress", *extra],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert "replica B reused" in done.stdout
            assert SECRET not in done.stdout + done.stderr


def test_tls_with_a_verified_server_certificate_shares_prefixes(tmp_path: Path) -> None:
    ca, cert, key = tls_files(tmp_path)
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
    for server in server_in(tmp_path, tls, tls=True):
        assert server.url.startswith("rediss://")
        a, tier_a = replica(server.url, tls_ca_file=str(ca))
        compute_and_store(a, tier_a, "r1", PROMPT)
        b, tier_b = replica(server.url.replace("rediss", "valkeys"), tls_ca_file=str(ca))
        assert admit(b, tier_b, b.arrive("r1", PROMPT)) is not None
        assert tier_b.counters().promoted == 6


def test_tls_refuses_a_server_the_ca_does_not_vouch_for(tmp_path: Path) -> None:
    ca, cert, key = tls_files(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _, _ = tls_files(tmp_path / "other")
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
    for server in server_in(tmp_path, tls, tls=True):
        b, tier_b = replica(server.url, tls_ca_file=str(other_ca))
        assert admit(b, tier_b, b.arrive("r1", PROMPT)) is None
        assert tier_b.counters().errors == 1
