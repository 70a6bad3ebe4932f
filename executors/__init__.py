"""Executors carry plans out as copies between GPU blocks and the pinned CPU tier.

They never decide what to move: that is `kvferry.core`'s job. (Filled in by the executors issue.)
"""
