/* Per-job host work, compiled: a bound plan's checks, batch slicing, run copies, a job's driver
 * calls, and all of these but the check in one call for the common staged job (stage_job).
 *
 * The compiled route of `kvferry.executors.jobcode`: an optional accelerator, built by
 * `pip install` where a C compiler works. `executors/_python.py` has the same functions, with
 * the same arguments and answers, and the executors run either (docs/executors.md says what
 * this module buys, measured). Each function here is specified by its caller's docstring and
 * tested through it, on both routes; none keeps state but the Submitter, a thread that makes
 * staged jobs' calls off the submitting thread.
 *
 * Integers cross as Python ints and tuples; int64 tables come back as `bytes`, which numpy
 * views without a copy (and read-only, as the planner's tables must be).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Widths of the planner's tables: keep equal to staging.SLICE_FIELDS and the slice tuple. */
#define SLICE_WIDTH 7
#define LINE_WIDTH 5
/* The first fields of a group tuple, in the order of staging._Group (which has more). */
enum { G_FIRST_REF, G_REFS, G_PAGE_PIECES, G_PAGE_BYTES, G_N, G_SKIP, G_KEYS, G_KEY0, G_ID0,
       G_SIZE, G_WIDTH };

/* A growable int64 array. */
typedef struct {
    int64_t *data;
    Py_ssize_t len, cap;
} Column;

static int push(Column *c, int64_t value) {
    if (c->len == c->cap) {
        Py_ssize_t cap = c->cap ? 2 * c->cap : 64;
        int64_t *data = PyMem_Realloc(c->data, (size_t)cap * sizeof(int64_t));
        if (!data) {
            PyErr_NoMemory();
            return -1;
        }
        c->data = data;
        c->cap = cap;
    }
    c->data[c->len++] = value;
    return 0;
}

static PyObject *as_bytes(const Column *c) {
    return PyBytes_FromStringAndSize((const char *)c->data, c->len * (Py_ssize_t)sizeof(int64_t));
}

static PyObject *as_tuple(const int64_t *values, Py_ssize_t n) {
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyLong_FromLongLong(values[i]);
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* Read a sequence of ints into a new array (PyMem); NULL with an exception on failure. */
static int64_t *read_ints(PyObject *sequence, Py_ssize_t *n, const char *what) {
    PyObject *fast = PySequence_Fast(sequence, what);
    if (!fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    int64_t *out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(int64_t));
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++) {
        out[i] = PyLong_AsLongLong(items[i]);
        if (out[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    return out;
}

/* Cut `n_groups` groups (G_WIDTH fields each) into staging batches, appending to the columns:
 * `table` the job's slice table (SLICE_WIDTH per line), `lines` its slices (LINE_WIDTH per slice:
 * batch, group, first key, keys, stage offset), `bounds` the batches' first slices (and the end),
 * the rest one value per batch. StagePlanner.plan states the rule. 0, or -1 with an exception. */
static int slice_into(const int64_t (*g)[G_WIDTH], Py_ssize_t n_groups, int small_first,
                      int64_t capacity, int64_t ramp, int64_t f, Column *table, Column *lines,
                      Column *bounds, Column *stage_bytes, Column *items, Column *nbytes) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n_groups; i++) total += g[i][G_KEYS] * g[i][G_SIZE];
    if (push(bounds, 0)) return -1;
    Py_ssize_t gi = 0;
    int64_t taken = 0, batched = 0;
    while (gi < n_groups) {
        int64_t left = total - batched;
        int64_t limit = small_first && batched == 0 ? ramp : capacity;
        if (!small_first && ramp < left && left <= capacity + ramp && left - ramp < limit)
            limit = left - ramp; /* leave a small last batch */
        int64_t used = 0, batch = stage_bytes->len, batch_items = 0, batch_bytes = 0;
        while (gi < n_groups) {
            const int64_t *group = g[gi];
            int64_t keys = group[G_KEYS], size = group[G_SIZE];
            int64_t room = limit > used ? (limit - used) / size : 0;
            int64_t count = room < keys - taken ? room : keys - taken;
            if (count == 0 && used) break;
            if (count == 0) count = 1; /* a row larger than the ramp still moves, alone */
            /* the slice's line of the table: positions start .. end - 1 of the group's rows */
            int64_t skip = group[G_SKIP];
            int64_t start = taken * f, end = (taken + count) * f, stop = skip + group[G_N];
            int64_t lo = start > skip ? start : skip;
            int64_t pages = (end < stop ? end : stop) - lo;
            if (push(lines, batch) || push(lines, gi) || push(lines, taken) ||
                push(lines, count) || push(lines, used) || push(table, group[G_FIRST_REF]) ||
                push(table, group[G_REFS]) || push(table, used) ||
                push(table, group[G_ID0] + lo - skip) || push(table, lo - start) ||
                push(table, pages) || push(table, batch_items))
                return -1;
            batch_items += pages * group[G_PAGE_PIECES];
            batch_bytes += pages * group[G_PAGE_BYTES];
            used += count * size;
            taken += count;
            if (taken < keys) break; /* the batch is full: not even one more of these keys fits */
            gi++;
            taken = 0;
        }
        if (push(bounds, lines->len / LINE_WIDTH) || push(stage_bytes, used) ||
            push(items, batch_items) || push(nbytes, batch_bytes))
            return -1;
        batched += used;
    }
    return 0;
}

/* slice_batches(groups, small_first, capacity, ramp, f)
 *   -> (table, lines, bounds, stage_bytes, items, nbytes)
 * `groups`: one tuple per group the plan moves, its first G_WIDTH fields ints. The columns of
 * slice_into: the two tables as bytes of int64, the rest as tuples. */
static PyObject *slice_batches(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *groups_in;
    int small_first;
    long long capacity, ramp, f;
    if (!PyArg_ParseTuple(args, "OpLLL", &groups_in, &small_first, &capacity, &ramp, &f))
        return NULL;
    PyObject *groups_fast = PySequence_Fast(groups_in, "groups must be a sequence");
    if (!groups_fast) return NULL;
    Py_ssize_t n_groups = PySequence_Fast_GET_SIZE(groups_fast);
    int64_t(*g)[G_WIDTH] = PyMem_Malloc((size_t)(n_groups ? n_groups : 1) * sizeof(*g));
    Column table = {0}, lines = {0}, bounds = {0}, stage_bytes = {0}, items = {0}, nbytes = {0};
    PyObject *result = NULL;
    if (!g) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_groups; i++) {
        Py_ssize_t width;
        int64_t *fields = read_ints(PySequence_Fast_GET_ITEM(groups_fast, i), &width,
                                    "a group must be a sequence");
        if (!fields) goto done;
        if (width < G_WIDTH) {
            PyMem_Free(fields);
            PyErr_Format(PyExc_ValueError, "a group has %zd fields, not %d", width, G_WIDTH);
            goto done;
        }
        memcpy(g[i], fields, sizeof(g[i]));
        PyMem_Free(fields);
    }
    if (slice_into((const int64_t(*)[G_WIDTH])g, n_groups, small_first, capacity, ramp, f,
                   &table, &lines, &bounds, &stage_bytes, &items, &nbytes))
        goto done;
    result = Py_BuildValue("(NNNNNN)", as_bytes(&table), as_bytes(&lines),
                           as_tuple(bounds.data, bounds.len),
                           as_tuple(stage_bytes.data, stage_bytes.len),
                           as_tuple(items.data, items.len), as_tuple(nbytes.data, nbytes.len));
done:
    PyMem_Free(g);
    PyMem_Free(table.data);
    PyMem_Free(lines.data);
    PyMem_Free(bounds.data);
    PyMem_Free(stage_bytes.data);
    PyMem_Free(items.data);
    PyMem_Free(nbytes.data);
    Py_DECREF(groups_fast);
    return result;
}

/* Per group of a job (the slices' group index), what its link copies need: its first row, the
 * offset of its region in the tier, its row pitch and its rows per registered piece (0: one). */
typedef struct {
    const int64_t *first_row, *base, *pitch, *per_piece;
} Runs;

/* Append the link copies of a job whose rows are, in each of its groups, one consecutive run to
 * `stage`, `tier` and `size`: one copy per slice (`n_lines` slices as slice_into lists them), cut
 * at multiples of the group's `per_piece` rows; `bounds` (batches + 1, zeroed) gets each batch's
 * end. 0, or -1 with an exception. */
static int run_into(const int64_t *line, Py_ssize_t n_lines, Py_ssize_t n_groups,
                    Py_ssize_t batches, Runs runs, Column *stage, Column *tier, Column *size,
                    int64_t *bounds) {
    for (Py_ssize_t i = 0; i < n_lines; i++, line += LINE_WIDTH) {
        int64_t b = line[0], gi = line[1], first = line[2], keys = line[3], at = line[4];
        if (b < 0 || b >= batches || gi < 0 || gi >= n_groups) {
            PyErr_SetString(PyExc_ValueError, "a slice names a batch or group out of range");
            return -1;
        }
        int64_t pitch = runs.pitch[gi], per_piece = runs.per_piece[gi], base = runs.base[gi];
        int64_t start = runs.first_row[gi] + first, row = start, end = start + keys;
        while (row < end) {
            int64_t stop = per_piece ? (row / per_piece + 1) * per_piece : end;
            if (stop > end) stop = end;
            if (push(stage, at + (row - start) * pitch) || push(tier, base + row * pitch) ||
                push(size, (stop - row) * pitch))
                return -1;
            row = stop;
        }
        bounds[b + 1] = size->len;
    }
    return 0;
}

/* run_copies(lines, key0, batches, first_row, base, pitch, per_piece, store)
 *   -> (src, dst, size, bounds)
 * run_into's copies as tuples, from `lines` as slice_batches returns them; the last four and
 * `key0` are sequences, one value per group of the job. */
static PyObject *run_copies(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer lines;
    PyObject *key0_in, *per_in[4];
    Py_ssize_t batches;
    int store;
    if (!PyArg_ParseTuple(args, "y*OnOOOOp", &lines, &key0_in, &batches, &per_in[0], &per_in[1],
                          &per_in[2], &per_in[3], &store))
        return NULL;
    Py_ssize_t n_groups, n_per[4] = {0};
    int64_t *key0 = read_ints(key0_in, &n_groups, "key0 must be a sequence");
    int64_t *per[4] = {NULL};
    for (int k = 0; k < 4 && key0; k++)
        if (!(per[k] = read_ints(per_in[k], &n_per[k], "per-group values must be a sequence")))
            break;
    Column stage = {0}, tier = {0}, size = {0};
    int64_t *bounds = PyMem_Calloc((size_t)batches + 1, sizeof(int64_t));
    PyObject *result = NULL;
    if (!key0 || !per[0] || !per[1] || !per[2] || !per[3] || !bounds) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < 4; k++)
        if (n_per[k] != n_groups) {
            PyErr_SetString(PyExc_ValueError, "the per-group values must be one per group");
            goto done;
        }
    Py_ssize_t n_lines = lines.len / (Py_ssize_t)(LINE_WIDTH * sizeof(int64_t));
    Runs runs = {per[0], per[1], per[2], per[3]};
    if (run_into(lines.buf, n_lines, n_groups, batches, runs, &stage, &tier, &size, bounds))
        goto done;
    const Column *src = store ? &stage : &tier, *dst = store ? &tier : &stage;
    result = Py_BuildValue("(NNNN)", as_tuple(src->data, src->len),
                           as_tuple(dst->data, dst->len), as_tuple(size.data, size.len),
                           as_tuple(bounds, batches + 1));
done:
    PyBuffer_Release(&lines);
    PyMem_Free(key0);
    for (int k = 0; k < 4; k++) PyMem_Free(per[k]);
    PyMem_Free(bounds);
    PyMem_Free(stage.data);
    PyMem_Free(tier.data);
    PyMem_Free(size.data);
    return result;
}

/* consecutive(rows) -> bool: whether the int64 buffer `rows` counts up by one throughout. */
static PyObject *consecutive(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer rows;
    if (PyObject_GetBuffer(arg, &rows, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (rows.itemsize != (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&rows);
        PyErr_SetString(PyExc_TypeError, "rows must be int64");
        return NULL;
    }
    const int64_t *r = rows.buf;
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t);
    int ok = 1;
    for (Py_ssize_t i = 1; i < n && ok; i++) ok = r[i] == r[i - 1] + 1;
    PyBuffer_Release(&rows);
    return PyBool_FromLong(ok);
}

/* An int64 C-contiguous view of `obj` into `view`: 1 on success, 0 when `obj` is not one
 * (no exception left set), -1 on another error. */
static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
        PyErr_Clear(); /* no buffer at all */
        return 0;
    }
    const char *format = view->format ? view->format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') format++;
    if (!PyBuffer_IsContiguous(view, 'C') || view->itemsize != (Py_ssize_t)sizeof(int64_t) ||
        (format[0] != 'q' && format[0] != 'l') || format[1] != '\0') {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static int64_t most(const int64_t *values, Py_ssize_t n) {
    int64_t m = values[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (values[i] > m) m = values[i];
    return m;
}

/* bound_bytes(ids, rows, group_sizes, block_indices, plan_f, f, num_blocks, copy_bytes,
 *             num_rows, store) -> int
 * The bytes a bound plan moves when every check of core.expand.check_bound certainly passes
 * (the same rule, in one pass); -1 when one fails or this cannot tell (ids or rows that are
 * not int64 and contiguous, or a store whose rows do not increase), and the caller then runs
 * check_bound itself, which raises its error or returns the bytes. `num_blocks` and
 * `copy_bytes` are the layout's per group, `num_rows` the tier's per group (empty: unchecked);
 * a store's rows must increase within each group (every group has its own rows). */
static PyObject *bound_bytes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ids_in, *rows_in, *sizes_in, *firsts_in, *blocks_in, *bytes_in, *limits_in;
    long long plan_f, f;
    int store;
    if (!PyArg_ParseTuple(args, "OOOOLLOOOp", &ids_in, &rows_in, &sizes_in, &firsts_in,
                          &plan_f, &f, &blocks_in, &bytes_in, &limits_in, &store))
        return NULL;
    Py_buffer ids_view, rows_view;
    int have_ids = int64_view(ids_in, &ids_view);
    if (have_ids < 0) return NULL;
    int have_rows = have_ids ? int64_view(rows_in, &rows_view) : 0;
    if (have_rows < 0) {
        PyBuffer_Release(&ids_view);
        return NULL;
    }
    Py_ssize_t n_groups = 0, n_firsts = 0, n_blocks = 0, n_bytes = 0, n_limits = 0;
    int64_t *sizes = NULL, *firsts = NULL, *blocks = NULL, *bytes = NULL, *limits = NULL;
    int64_t total = -1;
    PyObject *result = NULL;
    if (!have_rows) goto answer; /* not int64 views: check_bound decides */
    if (!(sizes = read_ints(sizes_in, &n_groups, "group_sizes must be a sequence")) ||
        !(firsts = read_ints(firsts_in, &n_firsts, "block_indices must be a sequence")) ||
        !(blocks = read_ints(blocks_in, &n_blocks, "num_blocks must be a sequence")) ||
        !(bytes = read_ints(bytes_in, &n_bytes, "copy_bytes must be a sequence")) ||
        !(limits = read_ints(limits_in, &n_limits, "num_rows must be a sequence")))
        goto done;
    if (plan_f != f || f < 1 || n_groups != n_blocks || n_firsts != n_groups ||
        n_bytes != n_groups || (n_limits && n_limits != n_groups))
        goto answer;
    const int64_t *ids = ids_view.buf, *rows = rows_view.buf;
    Py_ssize_t n_ids = ids_view.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t n_rows_all = rows_view.len / (Py_ssize_t)sizeof(int64_t);
    int64_t id_start = 0, key_start = 0, sum = 0;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        int64_t n = sizes[g], skip = ((firsts[g] % f) + f) % f; /* Python's % */
        if (n < 0) goto answer;
        int64_t n_rows = n ? (n + skip + f - 1) / f : 0;
        if (id_start + n > n_ids || key_start + n_rows > n_rows_all) goto answer;
        if (n) {
            if (most(ids + id_start, (Py_ssize_t)n) >= blocks[g]) goto answer;
            if (n_limits && most(rows + key_start, (Py_ssize_t)n_rows) >= limits[g]) goto answer;
            if (store)
                for (int64_t i = key_start + 1; i < key_start + n_rows; i++)
                    if (rows[i] <= rows[i - 1]) goto answer;
        }
        sum += n * bytes[g];
        id_start += n;
        key_start += n_rows;
    }
    if (id_start != n_ids || key_start != n_rows_all) goto answer;
    total = sum;
answer:
    result = PyLong_FromLongLong(total);
done:
    PyMem_Free(sizes);
    PyMem_Free(firsts);
    PyMem_Free(blocks);
    PyMem_Free(bytes);
    PyMem_Free(limits);
    if (have_rows) PyBuffer_Release(&rows_view);
    if (have_ids) PyBuffer_Release(&ids_view);
    return result;
}

/* The CUDA driver calls a job makes, as libcuda exports them. */
typedef int (*launch_fn)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                         unsigned block_x, unsigned block_y, unsigned block_z,
                         unsigned shared_bytes, void *stream, void **params, void **extra);
typedef int (*memcpy_fn)(uint64_t dst, uint64_t src, size_t nbytes, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);

/* A job's event records, stream waits and DMAs: each through a Python callable (the CPU test
 * doubles), or straight to the driver through its address. Events are then the callables'
 * objects, or integer handles. */
typedef struct {
    PyObject *record_call, *wait_call, *copy_call; /* or NULL */
    record_fn record;
    wait_fn wait;
    memcpy_fn copy;
} Driver;

/* An event as a job function takes it: the caller's object (a callable driver's own, an
 * integer handle, or None for no event) and, for a driver called by address, its handle,
 * resolved before the first call so that a submission thread needs no Python to use it. */
typedef struct {
    PyObject *object;
    void *handle;
} Event;

static int present(const Event *e) { return e->object != Py_None; }

/* Fill `e` from `object` for driver `d`; 0, or -1 with an exception (not an integer). */
static int resolve_event(const Driver *d, PyObject *object, Event *e) {
    e->object = object;
    e->handle = NULL;
    if (object == Py_None || (d->record_call && d->wait_call)) return 0;
    e->handle = PyLong_AsVoidPtr(object);
    return e->handle == NULL && PyErr_Occurred() ? -1 : 0;
}

static int resolve_events(const Driver *d, PyObject *const objects[], Event events[], int n) {
    for (int i = 0; i < n; i++)
        if (resolve_event(d, objects[i], &events[i])) return -1;
    return 0;
}

/* A job's staging-kernel launches: a Python callable, or straight to the driver. */
typedef struct {
    PyObject *call; /* StageCopy(stream, segments, count, stage, blocks), or NULL */
    launch_fn launch;
    void *function;
    unsigned threads;
    uint64_t refs, ids;
    int to_stage, piece;
} Kernel;

/* A job's table upload: a Python callable, or a launch of the table-copy kernel on one block
 * per `threads` values, at most `most`. */
typedef struct {
    PyObject *call; /* TableCopy(dst, src, count, stream), or NULL */
    launch_fn launch;
    void *function;
    unsigned threads, most;
    uint64_t dst, src;
    int64_t count;
} Upload;

/* An int that is either the address of a driver function or a callable; 0 on success. */
static int callable_or_address(PyObject *in, PyObject **call, void **address) {
    if (PyCallable_Check(in)) {
        *call = in;
        return 0;
    }
    *address = PyLong_AsVoidPtr(in);
    return *address == NULL && PyErr_Occurred() ? -1 : 0;
}

static int parse_driver(PyObject *in, Driver *d) {
    PyObject *record_in, *wait_in, *copy_in;
    void *record_at = NULL, *wait_at = NULL, *copy_at = NULL;
    if (!PyArg_ParseTuple(in, "OOO", &record_in, &wait_in, &copy_in) ||
        callable_or_address(record_in, &d->record_call, &record_at) ||
        callable_or_address(wait_in, &d->wait_call, &wait_at) ||
        callable_or_address(copy_in, &d->copy_call, &copy_at))
        return -1;
    d->record = (record_fn)(uintptr_t)record_at;
    d->wait = (wait_fn)(uintptr_t)wait_at;
    d->copy = (memcpy_fn)(uintptr_t)copy_at;
    return 0;
}

static int parse_kernel(PyObject *in, Kernel *k) {
    if (PyCallable_Check(in)) {
        k->call = in;
        return 0;
    }
    unsigned long long launch_at, function, refs, ids;
    if (!PyArg_ParseTuple(in, "KKIKKpi", &launch_at, &function, &k->threads, &refs, &ids,
                          &k->to_stage, &k->piece))
        return -1;
    k->launch = (launch_fn)(uintptr_t)launch_at;
    k->function = (void *)(uintptr_t)function;
    k->refs = refs;
    k->ids = ids;
    return 0;
}

/* The TableCopy part of an upload: a callable, or (cuLaunchKernel's address, CUfunction,
 * threads, most blocks). */
static int parse_table_copy(PyObject *in, Upload *u) {
    if (PyCallable_Check(in)) {
        u->call = in;
        return 0;
    }
    unsigned long long launch_at, function;
    if (!PyArg_ParseTuple(in, "KKII", &launch_at, &function, &u->threads, &u->most)) return -1;
    if (!u->threads || !u->most) {
        PyErr_SetString(PyExc_ValueError, "a table copy needs threads and blocks");
        return -1;
    }
    u->launch = (launch_fn)(uintptr_t)launch_at;
    u->function = (void *)(uintptr_t)function;
    return 0;
}

static int parse_upload(PyObject *in, Upload *u) {
    PyObject *copy_in;
    unsigned long long dst, src;
    long long count;
    if (!PyArg_ParseTuple(in, "OKKL", &copy_in, &dst, &src, &count)) return -1;
    u->dst = dst;
    u->src = src;
    u->count = count;
    return parse_table_copy(copy_in, u);
}

/* Each call below returns 0, -1 with a Python exception, or a CUDA error code (> 0) with
 * *failed naming the call. A callable answers None (or 0) when it made the call, or a CUDA
 * error code, which counts as the driver's. */
static int called(PyObject *result, const char *call, const char **failed) {
    if (!result) return -1;
    long status = 0;
    if (PyLong_Check(result)) {
        status = PyLong_AsLong(result);
        if (status == -1 && PyErr_Occurred()) {
            Py_DECREF(result);
            return -1;
        }
    }
    Py_DECREF(result);
    if (status <= 0) return 0;
    *failed = call;
    return (int)status;
}

static int record_event(const Driver *d, const Event *event, uint64_t stream,
                        const char **failed) {
    if (d->record_call)
        return called(PyObject_CallFunction(d->record_call, "OK", event->object,
                                            (unsigned long long)stream),
                      "cuEventRecord", failed);
    int status = d->record(event->handle, (void *)(uintptr_t)stream);
    if (status) *failed = "cuEventRecord";
    return status;
}

static int wait_event(const Driver *d, uint64_t stream, const Event *event,
                      const char **failed) {
    if (d->wait_call)
        return called(PyObject_CallFunction(d->wait_call, "KO", (unsigned long long)stream,
                                            event->object),
                      "cuStreamWaitEvent", failed);
    int status = d->wait((void *)(uintptr_t)stream, event->handle, 0);
    if (status) *failed = "cuStreamWaitEvent";
    return status;
}

static int copy(const Driver *d, uint64_t dst, uint64_t src, int64_t nbytes, uint64_t stream,
                const char **failed) {
    if (d->copy_call)
        return called(PyObject_CallFunction(d->copy_call, "KKLK", (unsigned long long)dst,
                                            (unsigned long long)src, (long long)nbytes,
                                            (unsigned long long)stream),
                      "cuMemcpyAsync", failed);
    int status = d->copy(dst, src, (size_t)nbytes, (void *)(uintptr_t)stream);
    if (status) *failed = "cuMemcpyAsync";
    return status;
}

static int launch(const Kernel *k, uint64_t stream, uint64_t segments, int count, uint64_t stage,
                  unsigned blocks, const char **failed) {
    if (k->call)
        return called(PyObject_CallFunction(k->call, "KKiKI", (unsigned long long)stream,
                                            (unsigned long long)segments, count,
                                            (unsigned long long)stage, blocks),
                      "cuLaunchKernel", failed);
    /* the kernel's parameters, in kernels.STAGE_COPY_SOURCE's order */
    uint64_t seg = segments, refs = k->refs, ids = k->ids, stg = stage;
    int n = count, to_stage = k->to_stage, piece = k->piece;
    void *params[] = {&seg, &n, &refs, &ids, &stg, &to_stage, &piece};
    int status = k->launch(k->function, blocks, 1, 1, k->threads, 1, 1, 0,
                           (void *)(uintptr_t)stream, params, NULL);
    if (status) *failed = "cuLaunchKernel";
    return status;
}

static int upload(const Upload *u, uint64_t stream, const char **failed) {
    if (u->call)
        return called(PyObject_CallFunction(u->call, "KKLK", (unsigned long long)u->dst,
                                            (unsigned long long)u->src, (long long)u->count,
                                            (unsigned long long)stream),
                      "cuLaunchKernel", failed);
    /* the kernel's parameters, in kernels.TABLE_COPY_SOURCE's order */
    uint64_t src = u->src, dst = u->dst;
    long long count = u->count;
    void *params[] = {&src, &dst, &count};
    int64_t blocks = (count + u->threads - 1) / u->threads;
    blocks = blocks < 1 ? 1 : (blocks > u->most ? u->most : blocks);
    int status = u->launch(u->function, (unsigned)blocks, 1, 1, u->threads, 1, 1, 0,
                           (void *)(uintptr_t)stream, params, NULL);
    if (status) *failed = "cuLaunchKernel";
    return status;
}

/* The job's first calls: `ready` recorded on the compute stream (unless `ready_recorded`: the
 * submitting thread did that), lane 0 waits for it and for the previous job of the direction
 * (its end event, unless None), then records `start`. */
static int begin(const Driver *d, const uint64_t lanes[2], uint64_t compute, int ready_recorded,
                 const Event *ready, const Event *previous, const Event *start,
                 const char **failed) {
    int status = ready_recorded ? 0 : record_event(d, ready, compute, failed);
    if (!status) status = wait_event(d, lanes[0], ready, failed);
    if (!status && present(previous)) status = wait_event(d, lanes[0], previous, failed);
    if (!status) status = record_event(d, start, lanes[0], failed);
    return status;
}

/* The job's last calls: `end` is recorded on the lane of its last batch (batch k runs on lane
 * k % 2; a job of no batch ends on lane 0), after the other lane's work when it has some. */
static int finish(const Driver *d, const uint64_t lanes[2], Py_ssize_t batches,
                  const Event *joined, const Event *end, const char **failed) {
    uint64_t last = batches ? lanes[(batches - 1) % 2] : lanes[0];
    int status = 0;
    if (batches > 1) {
        status = record_event(d, joined, lanes[batches % 2], failed);
        if (!status) status = wait_event(d, last, joined, failed);
    }
    if (!status) status = record_event(d, end, last, failed);
    return status;
}

/* What a job function returns: None, NULL with the exception, or (status, the call). */
static PyObject *outcome(int status, const char *failed) {
    if (status < 0) return NULL;
    return status ? Py_BuildValue("(is)", status, failed) : Py_NewRef(Py_None);
}

/* begin_job(driver, lanes, compute, ready, previous, start) -> None or (status, call)
 * StagedGpuExecutor._begin: a job's first calls (see begin above). */
static PyObject *begin_job(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *driver_in, *objects[3];
    unsigned long long lanes_in[2], compute;
    if (!PyArg_ParseTuple(args, "O(KK)KOOO", &driver_in, &lanes_in[0], &lanes_in[1], &compute,
                          &objects[0], &objects[1], &objects[2]))
        return NULL;
    Driver driver = {0};
    Event e[3];
    if (parse_driver(driver_in, &driver) || resolve_events(&driver, objects, e, 3)) return NULL;
    const uint64_t lanes[2] = {lanes_in[0], lanes_in[1]};
    const char *failed = NULL;
    return outcome(begin(&driver, lanes, compute, 0, &e[0], &e[1], &e[2], &failed), failed);
}

/* end_job(driver, lanes, batches, joined, end) -> None or (status, call)
 * StagedGpuExecutor._end: a job's last calls (see finish above). */
static PyObject *end_job(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *driver_in, *objects[2];
    unsigned long long lanes_in[2];
    Py_ssize_t batches;
    if (!PyArg_ParseTuple(args, "O(KK)nOO", &driver_in, &lanes_in[0], &lanes_in[1], &batches,
                          &objects[0], &objects[1]))
        return NULL;
    Driver driver = {0};
    Event e[2];
    if (parse_driver(driver_in, &driver) || resolve_events(&driver, objects, e, 2)) return NULL;
    const uint64_t lanes[2] = {lanes_in[0], lanes_in[1]};
    const char *failed = NULL;
    return outcome(finish(&driver, lanes, batches, &e[0], &e[1], &failed), failed);
}

/* The staging side of a job, the same for all its batches. */
typedef struct {
    uint64_t stages[2], host, segments;
    int store;
    int64_t line_bytes, most, warps;
} Staging;

/* A job's batch columns (StagePlan's): per batch its kernel items, bounds of its slice lines
 * and of its link copies (batches + 1 each); the link copies as offsets. */
typedef struct {
    Py_ssize_t batches;
    const int64_t *items, *lines, *link, *src, *dst, *size;
} Batches;

/* A whole staged job's calls, as queue_job documents them; `events` as its tuple; `ready`
 * recorded on the compute stream already when `ready_recorded`. */
static int queue(const Driver *d, const uint64_t lanes[2], uint64_t compute, int ready_recorded,
                 const Event events[6], const Upload *table, const Kernel *kernel,
                 const Staging *s, const Batches *b, const char **failed) {
    const Event *ready = &events[0], *previous = &events[1], *start = &events[2];
    const Event *uploaded = &events[3], *joined = &events[4], *end = &events[5];
    const Event none = {Py_None, NULL};
    Py_ssize_t batches = b->batches;
    int status = begin(d, lanes, compute, ready_recorded, ready, &none, start, failed);
    if (!status) status = upload(table, lanes[0], failed);
    if (!status) status = record_event(d, uploaded, lanes[0], failed);
    if (!status && batches > 1) /* after what lane 0 waited on, and the upload */
        status = wait_event(d, lanes[1], uploaded, failed);
    for (Py_ssize_t k = 0; k < batches && !status; k++) {
        uint64_t lane = lanes[k % 2], stage = s->stages[k % 2];
        uint64_t src_base = s->store ? stage : s->host, dst_base = s->store ? s->host : stage;
        int count = (int)(b->lines[k + 1] - b->lines[k]); /* none for a batch of no slice line */
        int64_t blocks = (b->items[k] + s->warps - 1) / s->warps;
        blocks = blocks ? (blocks < s->most ? blocks : s->most) : 1;
        uint64_t at = s->segments + (uint64_t)(s->line_bytes * b->lines[k]);
        if (s->store && count) /* gather, then copy out */
            status = launch(kernel, lane, at, count, stage, (unsigned)blocks, failed);
        if (!status && k == 0 && s->store && present(previous)) /* before writing the tier */
            status = wait_event(d, lane, previous, failed);
        for (int64_t i = b->link[k]; i < b->link[k + 1] && !status; i++)
            status = copy(d, dst_base + (uint64_t)b->dst[i], src_base + (uint64_t)b->src[i],
                          b->size[i], lane, failed);
        if (!status && k == 0 && !s->store && present(previous)) /* before writing KV blocks */
            status = wait_event(d, lane, previous, failed);
        if (!status && count && !s->store) /* copy in, then scatter */
            status = launch(kernel, lane, at, count, stage, (unsigned)blocks, failed);
    }
    if (!status && !batches && present(previous)) /* the end comes after the previous one's */
        status = wait_event(d, lanes[0], previous, failed);
    if (!status) status = finish(d, lanes, batches, joined, end, failed);
    return status;
}

/* queue_job(driver, lanes, compute, events, upload, kernel, batches) -> None or (status, call)
 * A whole staged job, as StagedGpuExecutor._enqueue_staged documents it: begin (above) without
 * the wait for the previous job, the table upload on lane 0 and its event (which lane 1 waits
 * for when the job has a second batch), the batch loop, finish (above). Lane 0 waits for the
 * previous job (its end event, unless None) in its first batch, just before the job first
 * writes memory that job may also write: a store's first DMA to the tier, a load's first
 * scatter into KV blocks (or before the end, for a job of no batch). `events` is (ready,
 * previous end or None, start, uploaded, joined, end); `upload` (TableCopy, dst, src, count),
 * the TableCopy a callable or (cuLaunchKernel's address, CUfunction, threads, most blocks);
 * `kernel` a StageCopy callable or a NativeLaunch tuple; `batches` (stages, host, store,
 * segments, line_bytes, most, warps, items, lines, link, src, dst, size). Everything is read and
 * checked before the first call; a driver error stops the job where it is, and an exception
 * from a callable propagates. */
static PyObject *queue_job(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *driver_in, *upload_in, *kernel_in, *batches_in;
    PyObject *events[6];
    unsigned long long lanes_in[2], compute;
    if (!PyArg_ParseTuple(args, "O(KK)K(OOOOOO)OOO", &driver_in, &lanes_in[0], &lanes_in[1],
                          &compute, &events[0], &events[1], &events[2], &events[3], &events[4],
                          &events[5], &upload_in, &kernel_in, &batches_in))
        return NULL;
    Driver driver = {0};
    Kernel kernel = {0};
    Upload table = {0};
    Event resolved[6];
    if (parse_driver(driver_in, &driver) || parse_upload(upload_in, &table) ||
        parse_kernel(kernel_in, &kernel) || resolve_events(&driver, events, resolved, 6))
        return NULL;
    unsigned long long stages[2], host, segments;
    long long line_bytes, most, warps;
    int store;
    PyObject *columns_in[6];
    if (!PyArg_ParseTuple(batches_in, "(KK)KpKLLLOOOOOO", &stages[0], &stages[1], &host, &store,
                          &segments, &line_bytes, &most, &warps, &columns_in[0], &columns_in[1],
                          &columns_in[2], &columns_in[3], &columns_in[4], &columns_in[5]))
        return NULL;
    int64_t *columns[6] = {0};
    Py_ssize_t lengths[6];
    PyObject *result = NULL;
    for (int c = 0; c < 6; c++) {
        columns[c] = read_ints(columns_in[c], &lengths[c], "plan columns must be sequences");
        if (!columns[c]) goto done;
    }
    Batches b = {lengths[0], columns[0], columns[1], columns[2],
                 columns[3], columns[4], columns[5]};
    if (lengths[1] != b.batches + 1 || lengths[2] != b.batches + 1 || lengths[3] != lengths[5] ||
        lengths[4] != lengths[5] || (b.batches && b.link[b.batches] > lengths[5])) {
        PyErr_SetString(PyExc_ValueError, "the plan's columns do not agree in length");
        goto done;
    }
    const uint64_t lanes[2] = {lanes_in[0], lanes_in[1]};
    const Staging staging = {{stages[0], stages[1]}, host, segments, store, line_bytes, most,
                             warps};
    const char *failed = NULL;
    int status =
        queue(&driver, lanes, compute, 0, resolved, &table, &kernel, &staging, &b, &failed);
    result = outcome(status, failed);
done:
    for (int c = 0; c < 6; c++) PyMem_Free(columns[c]);
    return result;
}

/* --- the submission thread (StagedGpuExecutor's `submit_thread` option) ----------------------
 *
 * A Submitter owns one thread that makes staged jobs' driver calls (queue above) in the order
 * stage_job hands them over, as tickets numbered from 1. A ticket holds copies of everything
 * queue reads, so the caller's buffers may change once stage_job returns. The thread runs no
 * Python for a driver called by address; for the callables of CPU tests it takes the GIL. It
 * makes the given CUDA context current once, before its first ticket. A ticket that fails is
 * remembered, by number, until `failure` takes it; later tickets still run, as later jobs
 * still queue when one job's submit fails. */

typedef int (*context_fn)(void *context);

typedef struct Ticket {
    struct Ticket *next;
    uint64_t number;
    int python; /* holds Python objects (a callable driver): run and freed under the GIL */
    Driver driver;
    Upload table;
    Kernel kernel;
    Staging staging;
    uint64_t lanes[2], compute;
    Event events[6];
    Batches batches;  /* its columns point into `values` */
    int64_t values[]; /* items, lines, link, src, dst, size */
} Ticket;

#define FAILURE_TEXT 200

typedef struct {
    uint64_t number;
    int status; /* a CUDA error, or -1 for a Python exception */
    char text[FAILURE_TEXT];
} Failure;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake, advanced;
    int running, stop;
    Ticket *head, *tail;
    uint64_t pushed, completed;
    Failure *failures;
    Py_ssize_t n_failures, cap_failures;
    context_fn set_context;
    void *context;
} Submitter;

/* A new ticket of queue's arguments (the Python objects of a callable driver referenced); NULL
 * with an exception when out of memory. */
static Ticket *new_ticket(const Driver *d, const uint64_t lanes[2], const Event events[6],
                          const Upload *table, const Kernel *kernel, const Staging *s,
                          const Batches *b) {
    Py_ssize_t n = b->batches, links = n ? b->link[n] : 0;
    size_t count = (size_t)(n + 2 * (n + 1) + 3 * links);
    Ticket *t = malloc(sizeof(Ticket) + count * sizeof(int64_t));
    if (!t) {
        PyErr_NoMemory();
        return NULL;
    }
    *t = (Ticket){.driver = *d, .table = *table, .kernel = *kernel, .staging = *s,
                  .lanes = {lanes[0], lanes[1]}};
    memcpy(t->events, events, sizeof(t->events));
    int64_t *at = t->values;
    const int64_t *columns[6] = {b->items, b->lines, b->link, b->src, b->dst, b->size};
    const Py_ssize_t lengths[6] = {n, n + 1, n + 1, links, links, links};
    const int64_t **into[6] = {&t->batches.items, &t->batches.lines, &t->batches.link,
                               &t->batches.src, &t->batches.dst, &t->batches.size};
    for (int c = 0; c < 6; c++) {
        if (lengths[c]) memcpy(at, columns[c], (size_t)lengths[c] * sizeof(int64_t));
        *into[c] = at;
        at += lengths[c];
    }
    t->batches.batches = n;
    t->python = d->record_call || d->wait_call || d->copy_call || table->call || kernel->call;
    if (t->python) {
        PyObject *objects[] = {d->record_call, d->wait_call, d->copy_call, table->call,
                               kernel->call};
        for (size_t i = 0; i < sizeof(objects) / sizeof(*objects); i++) Py_XINCREF(objects[i]);
        for (int i = 0; i < 6; i++) Py_INCREF(t->events[i].object);
    }
    return t;
}

/* Drop a Python ticket's references (with the GIL held). */
static void release_ticket(Ticket *t) {
    PyObject *objects[] = {t->driver.record_call, t->driver.wait_call, t->driver.copy_call,
                           t->table.call, t->kernel.call};
    for (size_t i = 0; i < sizeof(objects) / sizeof(*objects); i++) Py_XDECREF(objects[i]);
    for (int i = 0; i < 6; i++) Py_DECREF(t->events[i].object);
}

/* The pending exception as "Type: message" in `text` (cleared); with the GIL held. */
static void describe_exception(char text[FAILURE_TEXT]) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *message = value ? PyObject_Str(value) : NULL;
    const char *name = type ? ((PyTypeObject *)type)->tp_name : "Exception";
    const char *said = message ? PyUnicode_AsUTF8(message) : NULL;
    snprintf(text, FAILURE_TEXT, "%s: %s", name, said ? said : "(no message)");
    PyErr_Clear();
    Py_XDECREF(message);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* Remember ticket `number`'s failure (with the lock held). Without memory for it the failure
 * is lost and the job reads as ended; nothing better is possible there. */
static void remember_failure(Submitter *s, uint64_t number, int status, const char *text) {
    if (s->n_failures == s->cap_failures) {
        Py_ssize_t cap = s->cap_failures ? 2 * s->cap_failures : 8;
        Failure *grown = realloc(s->failures, (size_t)cap * sizeof(Failure));
        if (!grown) return;
        s->failures = grown;
        s->cap_failures = cap;
    }
    Failure *f = &s->failures[s->n_failures++];
    f->number = number;
    f->status = status;
    snprintf(f->text, FAILURE_TEXT, "%s", text ? text : "unknown call");
}

static void *submit_tickets(void *arg) {
    Submitter *s = arg;
    int context_status = s->set_context ? s->set_context(s->context) : 0;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        while (!s->head && !s->stop) pthread_cond_wait(&s->wake, &s->lock);
        Ticket *t = s->head;
        if (t) {
            s->head = t->next;
            if (!s->head) s->tail = NULL;
        }
        pthread_mutex_unlock(&s->lock);
        if (!t) break;
        int status = context_status;
        const char *failed = context_status ? "cuCtxSetCurrent" : NULL;
        char text[FAILURE_TEXT] = "";
        if (t->python) {
            PyGILState_STATE gil = PyGILState_Ensure();
            if (!status)
                status = queue(&t->driver, t->lanes, t->compute, 1, t->events, &t->table,
                               &t->kernel, &t->staging, &t->batches, &failed);
            if (status < 0) describe_exception(text);
            release_ticket(t);
            PyGILState_Release(gil);
        } else if (!status) {
            status = queue(&t->driver, t->lanes, t->compute, 1, t->events, &t->table, &t->kernel,
                           &t->staging, &t->batches, &failed);
        }
        pthread_mutex_lock(&s->lock);
        if (status) remember_failure(s, t->number, status, status < 0 ? text : failed);
        s->completed = t->number;
        pthread_cond_broadcast(&s->advanced);
        pthread_mutex_unlock(&s->lock);
        free(t);
    }
    return NULL;
}

/* Hand `t` to the thread; its number, or 0 with an exception when the submitter is closed. */
static uint64_t push_ticket(Submitter *s, Ticket *t) {
    pthread_mutex_lock(&s->lock);
    if (!s->running) {
        pthread_mutex_unlock(&s->lock);
        if (t->python) release_ticket(t);
        free(t);
        PyErr_SetString(PyExc_RuntimeError, "the submission thread is closed");
        return 0;
    }
    t->next = NULL;
    t->number = ++s->pushed;
    if (s->tail)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
    return t->number;
}

/* Block, without the GIL, until ticket `number` has been made (every ticket for 0 and past). */
static void wait_for(Submitter *s, uint64_t number) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->lock);
    uint64_t until = number && number < s->pushed ? number : s->pushed;
    while (s->completed < until) pthread_cond_wait(&s->advanced, &s->lock);
    pthread_mutex_unlock(&s->lock);
    Py_END_ALLOW_THREADS
}

static void stop_thread(Submitter *s) {
    pthread_mutex_lock(&s->lock);
    int running = s->running;
    s->running = 0;
    s->stop = 1;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
    if (running) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(s->thread, NULL);
        Py_END_ALLOW_THREADS
    }
}

static int Submitter_init(Submitter *s, PyObject *args, PyObject *kwds) {
    static char *names[] = {"set_context", "context", NULL};
    unsigned long long set_context = 0, context = 0;
    if (s->running || s->stop) {
        PyErr_SetString(PyExc_RuntimeError, "a Submitter is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|KK", names, &set_context, &context))
        return -1;
    s->set_context = (context_fn)(uintptr_t)set_context;
    s->context = (void *)(uintptr_t)context;
    if (pthread_mutex_init(&s->lock, NULL) || pthread_cond_init(&s->wake, NULL) ||
        pthread_cond_init(&s->advanced, NULL)) {
        PyErr_SetString(PyExc_RuntimeError, "could not make the submission thread's lock");
        return -1;
    }
    int error = pthread_create(&s->thread, NULL, submit_tickets, s);
    if (error) {
        PyErr_Format(PyExc_RuntimeError, "could not start the submission thread (error %d)",
                     error);
        return -1;
    }
    s->running = 1;
    return 0;
}

static void Submitter_dealloc(Submitter *s) {
    if (s->running || s->stop) { /* initialised: stop the thread, then free what it used */
        stop_thread(s);
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->wake);
        pthread_cond_destroy(&s->advanced);
    }
    free(s->failures);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Submitter_finished(Submitter *s, PyObject *arg) {
    unsigned long long number = PyLong_AsUnsignedLongLong(arg);
    if (number == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&s->lock);
    int finished = s->completed >= number;
    pthread_mutex_unlock(&s->lock);
    return PyBool_FromLong(finished);
}

static PyObject *Submitter_wait(Submitter *s, PyObject *arg) {
    unsigned long long number = PyLong_AsUnsignedLongLong(arg);
    if (number == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    wait_for(s, number);
    Py_RETURN_NONE;
}

static PyObject *Submitter_drain(Submitter *s, PyObject *unused) {
    (void)unused;
    wait_for(s, 0);
    Py_RETURN_NONE;
}

static PyObject *Submitter_failure(Submitter *s, PyObject *arg) {
    unsigned long long number = PyLong_AsUnsignedLongLong(arg);
    if (number == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Failure found = {0};
    pthread_mutex_lock(&s->lock);
    for (Py_ssize_t i = 0; i < s->n_failures; i++)
        if (s->failures[i].number == number) {
            found = s->failures[i];
            s->failures[i] = s->failures[--s->n_failures];
            break;
        }
    pthread_mutex_unlock(&s->lock);
    if (!found.number) Py_RETURN_NONE;
    return Py_BuildValue("(is)", found.status, found.text);
}

static PyObject *Submitter_close(Submitter *s, PyObject *unused) {
    (void)unused;
    stop_thread(s);
    Py_RETURN_NONE;
}

static PyObject *Submitter_pushed(Submitter *s, void *closure) {
    (void)closure;
    pthread_mutex_lock(&s->lock);
    uint64_t pushed = s->pushed;
    pthread_mutex_unlock(&s->lock);
    return PyLong_FromUnsignedLongLong(pushed);
}

static PyMethodDef Submitter_methods[] = {
    {"finished", (PyCFunction)Submitter_finished, METH_O,
     "Whether the thread has made ticket `number`'s calls."},
    {"wait", (PyCFunction)Submitter_wait, METH_O,
     "Block, without the GIL, until ticket `number`'s calls are made."},
    {"drain", (PyCFunction)Submitter_drain, METH_NOARGS,
     "Block, without the GIL, until every ticket handed over is made."},
    {"failure", (PyCFunction)Submitter_failure, METH_O,
     "Take ticket `number`'s failure: None, or (status, call or exception)."},
    {"close", (PyCFunction)Submitter_close, METH_NOARGS,
     "Make every ticket, then stop the thread (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Submitter_getset[] = {
    {"pushed", (getter)Submitter_pushed, NULL, "The number of the last ticket handed over.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SubmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvferry.executors._native.Submitter",
    .tp_doc = "A thread that makes staged jobs' driver calls in the order handed over.",
    .tp_basicsize = sizeof(Submitter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Submitter_init,
    .tp_dealloc = (destructor)Submitter_dealloc,
    .tp_methods = Submitter_methods,
    .tp_getset = Submitter_getset,
};

/* What stage_job knows of a layout group (StagePlanner.job_constants). */
enum { R_FIRST_REF, R_REFS, R_PAGE_PIECES, R_PAGE_BYTES, R_SIZE, R_DENSE, R_BASE, R_PER_PIECE,
       R_WIDTH };

/* stage_job(constants, first, compute, previous, start, end, slot, ids, rows, group_sizes,
 *           block_indices, submitter=None, ready=None)
 *   -> (batches or -1, None or (status, call))
 * A staged job planned and queued in one call, for the common job: its rows one consecutive
 * run, every group it moves filling its rows and, for a store, its chunks whole and its pages
 * unpadded. Then it plans as StagePlanner.plan, writes the ids and slice table after the ref
 * table into the slot's pinned view as StagedGpuExecutor._write_tables does, and queues the job
 * as queue_job, starting on lane `first`; it returns the job's batches and queue_job's answer.
 * For any other job, or a slot too small, it returns (-1, None) having written and queued
 * nothing, and the caller takes the Python path (StagedGpuExecutor._queue_planned), which is
 * this function's specification: tests/executors/test_stage_job.py holds the two to the same
 * calls and tables.
 * `constants`: (driver, lanes, stages, (ready, uploaded, joined), TableCopy, host, store,
 *   most blocks, warps, (capacity, ramp, f, ref_values, groups)), with
 *   one R_WIDTH tuple per layout group in `groups`;
 * `slot`: (view, its address, its GPU tables' address, the StageKernel of the slot's jobs);
 * `ids`, `rows`: int64 buffers (anything else is declined), checked by the caller.
 * With a `submitter`, the job's `ready` is recorded on the compute stream here and the rest of
 * its calls go to the submitter's thread as the next ticket (`submitter.pushed` after the call):
 * the answer is then that record's, and the ticket's is `submitter.failure(number)`. A `ready`
 * event given replaces the direction's in `constants` (a job's own, so that a later job's
 * record cannot move what this one waits for before the thread has made its wait). */
static PyObject *stage_job(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *constants, *slot_in, *ids_in, *rows_in, *sizes_in, *firsts_in;
    PyObject *events[6], *submitter_in = Py_None, *ready_in = Py_None;
    int first;
    unsigned long long compute;
    if (!PyArg_ParseTuple(args, "OpKOOOOOOOO|OO", &constants, &first, &compute, &events[1],
                          &events[2], &events[5], &slot_in, &ids_in, &rows_in, &sizes_in,
                          &firsts_in, &submitter_in, &ready_in))
        return NULL;
    Submitter *submitter = NULL;
    if (submitter_in != Py_None) {
        if (!PyObject_TypeCheck(submitter_in, &SubmitterType)) {
            PyErr_SetString(PyExc_TypeError, "submitter must be a Submitter or None");
            return NULL;
        }
        submitter = (Submitter *)submitter_in;
    }
    PyObject *driver_in, *table_in, *groups_in, *slot_view_in, *kernel_in;
    unsigned long long lanes_in[2], stages_in[2], host, slot_address, tables;
    long long most, warps, capacity, ramp, f, ref_values;
    int store;
    if (!PyArg_ParseTuple(constants, "O(KK)(KK)(OOO)OKpLL(LLLLO)", &driver_in, &lanes_in[0],
                          &lanes_in[1], &stages_in[0], &stages_in[1], &events[0], &events[3],
                          &events[4], &table_in, &host, &store, &most, &warps, &capacity, &ramp,
                          &f, &ref_values, &groups_in) ||
        !PyArg_ParseTuple(slot_in, "OKKO", &slot_view_in, &slot_address, &tables, &kernel_in))
        return NULL;
    if (ready_in != Py_None) events[0] = ready_in; /* the job's own, not the direction's */
    Driver driver = {0};
    Kernel kernel = {0};
    Upload table = {0};
    Event resolved[6];
    if (parse_driver(driver_in, &driver) || parse_table_copy(table_in, &table) ||
        parse_kernel(kernel_in, &kernel) || resolve_events(&driver, events, resolved, 6))
        return NULL;
    Py_buffer ids_view, rows_view, slot_view;
    int have_ids = 0, have_rows = 0, have_slot = 0;
    Py_ssize_t n_groups = 0, n_firsts = 0;
    int64_t *sizes = NULL, *firsts = NULL, *key0 = NULL, *link = NULL, *runs_at = NULL;
    int64_t(*g)[G_WIDTH] = NULL;
    Column slices = {0}, lines = {0}, bounds = {0}, stage_bytes = {0}, items = {0},
           nbytes = {0}, stage = {0}, tier = {0}, size = {0};
    PyObject *result = NULL, *groups_fast = NULL;
    if ((have_ids = int64_view(ids_in, &ids_view)) < 0 ||
        (have_rows = int64_view(rows_in, &rows_view)) < 0)
        goto done;
    if (!have_ids || !have_rows) goto decline;
    if (PyObject_GetBuffer(slot_view_in, &slot_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_slot = 1;
    if (!(sizes = read_ints(sizes_in, &n_groups, "group_sizes must be a sequence")) ||
        !(firsts = read_ints(firsts_in, &n_firsts, "block_indices must be a sequence")) ||
        !(groups_fast = PySequence_Fast(groups_in, "groups must be a sequence")))
        goto done;
    if (n_firsts != n_groups || PySequence_Fast_GET_SIZE(groups_fast) != n_groups || f < 1)
        goto decline;
    const int64_t *ids = ids_view.buf, *rows = rows_view.buf;
    Py_ssize_t n_ids = ids_view.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t n_rows = rows_view.len / (Py_ssize_t)sizeof(int64_t);
    /* the groups the plan moves, as StagePlanner._groups lists them */
    g = PyMem_Malloc((size_t)(n_groups ? n_groups : 1) * sizeof(*g));
    key0 = PyMem_Malloc((size_t)(n_groups ? n_groups : 1) * sizeof(int64_t));
    /* per group moved: first row, region offset, pitch, rows per piece (Runs) */
    runs_at = PyMem_Malloc((size_t)(n_groups ? n_groups : 1) * 4 * sizeof(int64_t));
    if (!g || !key0 || !runs_at) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t moved = 0;
    int64_t next_key = 0, next_id = 0;
    for (Py_ssize_t i = 0; i < n_groups; i++) {
        int64_t n = sizes[i], skip = ((firsts[i] % f) + f) % f;
        int64_t keys = n > 0 ? (n + skip + f - 1) / f : 0;
        if (keys) {
            Py_ssize_t width;
            int64_t *refs = read_ints(PySequence_Fast_GET_ITEM(groups_fast, i), &width,
                                      "a group must be a sequence");
            if (!refs) goto done;
            int fits = width == R_WIDTH && next_key + keys <= n_rows &&
                       (!store || (refs[R_DENSE] && !skip && n == keys * f));
            for (int64_t k = next_key + 1; fits && k < next_key + keys; k++)
                fits = rows[k] == rows[k - 1] + 1; /* the group's rows: one run */
            if (fits) {
                runs_at[moved] = rows[next_key];
                runs_at[n_groups + moved] = refs[R_BASE];
                runs_at[2 * n_groups + moved] = refs[R_SIZE];
                runs_at[3 * n_groups + moved] = refs[R_PER_PIECE];
            }
            int64_t *out = g[moved];
            out[G_FIRST_REF] = refs[R_FIRST_REF];
            out[G_REFS] = refs[R_REFS];
            out[G_PAGE_PIECES] = refs[R_PAGE_PIECES];
            out[G_PAGE_BYTES] = refs[R_PAGE_BYTES];
            out[G_SIZE] = refs[R_SIZE];
            PyMem_Free(refs);
            if (!fits) goto decline; /* rows it fills in part, or pages copied one by one */
            out[G_N] = n;
            out[G_SKIP] = skip;
            out[G_KEYS] = keys;
            out[G_KEY0] = next_key;
            out[G_ID0] = next_id;
            key0[moved++] = next_key;
        }
        next_key += keys;
        next_id += n;
    }
    if (next_key != n_rows || next_id != n_ids) goto decline;
    if (slice_into((const int64_t(*)[G_WIDTH])g, moved, store, capacity, ramp, f, &slices,
                   &lines, &bounds, &stage_bytes, &items, &nbytes))
        goto done;
    Py_ssize_t batches = stage_bytes.len;
    int64_t values = ref_values + n_ids + slices.len;
    if (values * (int64_t)sizeof(int64_t) > slot_view.len) goto decline;
    if (!(link = PyMem_Calloc((size_t)batches + 1, sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    Runs runs = {runs_at, runs_at + n_groups, runs_at + 2 * n_groups, runs_at + 3 * n_groups};
    if (run_into(lines.data, lines.len / LINE_WIDTH, moved, batches, runs, &stage, &tier, &size,
                 link))
        goto done;
    int64_t *view = slot_view.buf;
    if (n_ids) memcpy(view + ref_values, ids, (size_t)n_ids * sizeof(int64_t));
    if (slices.len)
        memcpy(view + ref_values + n_ids, slices.data, (size_t)slices.len * sizeof(int64_t));
    uint64_t ids_at = tables + (uint64_t)ref_values * sizeof(int64_t);
    table.dst = tables;
    table.src = slot_address;
    table.count = values;
    const uint64_t lanes[2] = {lanes_in[first], lanes_in[!first]};
    const Staging staging = {{stages_in[first], stages_in[!first]}, host,
                             ids_at + (uint64_t)n_ids * sizeof(int64_t), store,
                             SLICE_WIDTH * (int64_t)sizeof(int64_t), most, warps};
    const Column *src = store ? &stage : &tier, *dst = store ? &tier : &stage;
    const Batches b = {batches, items.data, bounds.data, link, src->data, dst->data, size.data};
    const char *failed = NULL;
    int status;
    if (submitter) { /* `ready` marks the compute work queued before this submit: record it now */
        status = record_event(&driver, &resolved[0], compute, &failed);
        if (!status) {
            Ticket *ticket = new_ticket(&driver, lanes, resolved, &table, &kernel, &staging, &b);
            if (!ticket) goto done;
            ticket->compute = compute;
            if (!push_ticket(submitter, ticket)) goto done;
        }
    } else {
        status = queue(&driver, lanes, compute, 0, resolved, &table, &kernel, &staging, &b,
                       &failed);
    }
    PyObject *failure = outcome(status, failed);
    if (failure) result = Py_BuildValue("(nN)", batches, failure);
    goto done;
decline:
    result = Py_BuildValue("(iO)", -1, Py_None);
done:
    PyMem_Free(sizes);
    PyMem_Free(firsts);
    PyMem_Free(key0);
    PyMem_Free(runs_at);
    PyMem_Free(link);
    PyMem_Free(g);
    Column *columns[] = {&slices, &lines, &bounds, &stage_bytes, &items,
                         &nbytes, &stage, &tier, &size};
    for (size_t c = 0; c < sizeof(columns) / sizeof(*columns); c++) PyMem_Free(columns[c]->data);
    Py_XDECREF(groups_fast);
    if (have_slot) PyBuffer_Release(&slot_view);
    if (have_rows > 0) PyBuffer_Release(&rows_view);
    if (have_ids > 0) PyBuffer_Release(&ids_view);
    return result;
}

static PyMethodDef methods[] = {
    {"slice_batches", slice_batches, METH_VARARGS, "Cut a job's keys into staging batches."},
    {"run_copies", run_copies, METH_VARARGS, "Link copies of a job on one run of rows."},
    {"consecutive", consecutive, METH_O, "Whether int64 rows count up by one."},
    {"bound_bytes", bound_bytes, METH_VARARGS, "The bytes of a bound plan that fits, else -1."},
    {"begin_job", begin_job, METH_VARARGS, "Queue a job's first event records and waits."},
    {"end_job", end_job, METH_VARARGS, "Queue a job's last event records and waits."},
    {"queue_job", queue_job, METH_VARARGS, "Queue a whole staged job."},
    {"stage_job", stage_job, METH_VARARGS, "Plan and queue a common staged job, else -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The staged path's per-job loops, compiled (see executors/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&SubmitterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Submitter", (PyObject *)&SubmitterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
