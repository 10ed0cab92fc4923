// SPDX-License-Identifier: Apache-2.0
/*
 * CPython glue for native_io._native_io: IOEngine, Writer, Reader, crc32c and
 * info. Buffers are pinned (Py_buffer) while in use and released on every
 * path; all copying, checksumming and I/O runs with the GIL released.
 *
 * Built twice by setup.py: the release module, and with -DNATIVE_IO_TESTING
 * native_io._native_io_testing, which adds the test-only _inject_faults.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "nio.h"
#include "read_progress.h"
#include "span.h"

/* The init symbol must match the last component of the module name. */
#ifdef NATIVE_IO_TESTING
#define NIO_MODULE_NAME	  "native_io._native_io_testing"
#define NIO_PYINIT	  PyInit__native_io_testing
#define NIO_TESTING_BUILD 1
#else
#define NIO_MODULE_NAME	  "native_io._native_io"
#define NIO_PYINIT	  PyInit__native_io
#define NIO_TESTING_BUILD 0
#endif

static PyObject *NativeIOError;
static PyTypeObject EngineType, WriterType, ReaderType;

static const char *kind_name(int kind)
{
	return kind == NIO_URING ? "uring" : "portable";
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Raise NativeIOError(errno, "strerror (op at offset N)", path). */
static PyObject *raise_io(int err, PyObject *path, const char *op, int has_off, uint64_t off,
			  const char *detail)
{
	PyObject *exc, *v;
	char msg[512];

	if (has_off)
		snprintf(msg, sizeof(msg), "%s (%s at offset %llu%s%s)", strerror(err), op,
			 (unsigned long long)off, detail ? ": " : "", detail ? detail : "");
	else
		snprintf(msg, sizeof(msg), "%s (%s%s%s)", strerror(err), op, detail ? ": " : "",
			 detail ? detail : "");
	exc = PyObject_CallFunction(NativeIOError, "isO", err, msg, path ? path : Py_None);
	if (!exc)
		return NULL;
	v = PyUnicode_FromString(op);
	if (!v || PyObject_SetAttrString(exc, "operation", v) < 0)
		goto out;
	Py_DECREF(v);
	v = has_off ? PyLong_FromUnsignedLongLong(off) : Py_NewRef(Py_None);
	if (!v || PyObject_SetAttrString(exc, "offset", v) < 0)
		goto out;
	Py_DECREF(v);
	PyErr_SetObject(NativeIOError, exc);
	Py_DECREF(exc);
	return NULL;
out:
	Py_XDECREF(v);
	Py_DECREF(exc);
	return NULL;
}

static PyObject *raise_nio(struct nio_error *e, PyObject *path)
{
	return raise_io(e->err, path, e->op, e->has_off, e->off, NULL);
}

/* ------------------------------------------------------------------ */
/* uring availability (probed once)                                    */

static int probe_done, probe_err;
static char probe_why[256];

static int uring_usable(const char **why)
{
	static char sim[160];

	if (!nio_uring_compiled()) {
		*why = "native_io was built without liburing";
		return 0;
	}
	if (NIO_FAULT(refuse_uring)) {
		snprintf(sim, sizeof(sim),
			 "io_uring_queue_init failed: %s (simulated by _inject_faults)",
			 strerror(EPERM));
		*why = sim;
		return 0;
	}
	if (!probe_done) {
		Py_BEGIN_ALLOW_THREADS
		probe_err = nio_uring_probe(probe_why, sizeof(probe_why));
		Py_END_ALLOW_THREADS
		probe_done = 1;
	}
	*why = probe_err ? probe_why : NULL;
	return !probe_err;
}

/* ------------------------------------------------------------------ */
/* IOEngine                                                            */

typedef struct {
	PyObject_HEAD
	int kind;      /* engine in use */
	int requested; /* 0 = auto */
	unsigned long long block_size;
	unsigned int qd;
	unsigned int stall_ms;	   /* completion_timeout of its writers, in ms (0: no bound) */
	char direct;		   /* char: exposed as a T_BOOL member */
	struct nio_ctx *cache[3];  /* idle contexts, by kind */
	PyObject *fallback_reason; /* str or None */
} EngineObject;

static struct nio_ctx *engine_take_ctx(EngineObject *eng, int kind)
{
	struct nio_ctx *ctx = eng->cache[kind];
	char why[256] = "";
	int err;

	if (ctx) {
		eng->cache[kind] = NULL;
		if (ctx->pid == getpid())
			return ctx;
		/*
		 * Inherited across fork(): the worker threads / ring belong to
		 * the parent. Abandon it (a one-time leak in the child).
		 */
		ctx = NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	err = nio_ctx_create(kind, eng->block_size, eng->qd, &ctx, why, sizeof(why));
	Py_END_ALLOW_THREADS
	if (err) {
		if (err == ENOMEM)
			PyErr_NoMemory();
		else
			PyErr_Format(PyExc_RuntimeError,
				     "native_io: cannot start the %s engine: %s", kind_name(kind),
				     why);
		return NULL;
	}
	return ctx;
}

static void destroy_ctx_nogil(struct nio_ctx *ctx)
{
	Py_BEGIN_ALLOW_THREADS
	nio_ctx_destroy(ctx);
	Py_END_ALLOW_THREADS
}

static void engine_return_ctx(EngineObject *eng, struct nio_ctx *ctx)
{
	if (!ctx || ctx->pid != getpid())
		return; /* see engine_take_ctx: never touch a parent's ctx */
	if (!ctx->broken && !ctx->inflight && !eng->cache[ctx->kind]) {
		eng->cache[ctx->kind] = ctx;
		return;
	}
	destroy_ctx_nogil(ctx);
}

static void engine_release_all(EngineObject *eng)
{
	for (int k = 0; k < 3; k++) {
		struct nio_ctx *ctx = eng->cache[k];

		eng->cache[k] = NULL;
		if (ctx && ctx->pid == getpid())
			destroy_ctx_nogil(ctx);
	}
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "engine", "block_size",	  "queue_depth",
				  "direct", "completion_timeout", NULL };
	const char *engine = "auto";
	Py_ssize_t bs = NIO_DEFAULT_BLOCK, qd = NIO_DEFAULT_QD;
	double timeout = NIO_STALL_LIMIT_MS / 1000.0;
	int direct = 1, want;
	const char *why = NULL;
	struct nio_ctx *ctx;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|snnpd", kwlist, &engine, &bs, &qd, &direct,
					 &timeout))
		return -1;
	if (!(timeout >= 0 && timeout <= 86400)) {
		char got[64];

		snprintf(got, sizeof(got), "%g", timeout);
		PyErr_Format(
			PyExc_ValueError,
			"completion_timeout must be between 0 (no bound) and 86400 seconds, got %s",
			got);
		return -1;
	}
	if (!strcmp(engine, "auto"))
		want = 0;
	else if (!strcmp(engine, "uring"))
		want = NIO_URING;
	else if (!strcmp(engine, "portable"))
		want = NIO_PORTABLE;
	else {
		PyErr_Format(PyExc_ValueError,
			     "engine must be 'auto', 'uring' or 'portable', not %R",
			     PyTuple_Size(args) ? PyTuple_GET_ITEM(args, 0) : Py_None);
		return -1;
	}
	if (bs < (Py_ssize_t)NIO_ALIGN || bs % NIO_ALIGN || bs > (Py_ssize_t)NIO_MAX_BLOCK) {
		PyErr_Format(PyExc_ValueError,
			     "block_size must be a multiple of %u between %u and %u, got %zd",
			     NIO_ALIGN, NIO_ALIGN, NIO_MAX_BLOCK, bs);
		return -1;
	}
	if (qd < 1 || qd > (Py_ssize_t)NIO_MAX_QD) {
		PyErr_Format(PyExc_ValueError, "queue_depth must be between 1 and %u, got %zd",
			     NIO_MAX_QD, qd);
		return -1;
	}
	engine_release_all(self);
	Py_CLEAR(self->fallback_reason);
	self->requested = want;
	self->block_size = (size_t)bs;
	self->qd = (unsigned)qd;
	self->stall_ms = timeout > 0 && timeout < 0.001 ? 1 : (unsigned)(timeout * 1000.0);
	self->direct = direct;

	if (want != NIO_PORTABLE) {
		if (uring_usable(&why)) {
			self->kind = NIO_URING;
			ctx = engine_take_ctx(self, NIO_URING);
			if (ctx) {
				self->cache[NIO_URING] = ctx;
				return 0;
			}
			if (want == NIO_URING)
				return -1;
			/* auto: keep the reason, fall back below */
			{
				PyObject *t, *v, *tb, *s;

				PyErr_Fetch(&t, &v, &tb);
				s = v ? PyObject_Str(v) : NULL;
				Py_XDECREF(t);
				Py_XDECREF(v);
				Py_XDECREF(tb);
				if (!s)
					return -1;
				self->fallback_reason = s;
			}
		} else {
			if (want == NIO_URING) {
				PyErr_Format(PyExc_RuntimeError,
					     "native_io: the io_uring engine is not usable: %s",
					     why);
				return -1;
			}
			self->fallback_reason = PyUnicode_FromString(why);
			if (!self->fallback_reason)
				return -1;
		}
	}
	self->kind = NIO_PORTABLE;
	ctx = engine_take_ctx(self, NIO_PORTABLE);
	if (!ctx)
		return -1;
	self->cache[NIO_PORTABLE] = ctx;
	return 0;
}

static void Engine_dealloc(EngineObject *self)
{
	engine_release_all(self);
	Py_CLEAR(self->fallback_reason);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_get_engine(EngineObject *self, void *c)
{
	return PyUnicode_FromString(kind_name(self->kind));
}

static PyObject *Engine_get_arena_bytes(EngineObject *self, void *c)
{
	size_t n = 0;

	for (int k = 0; k < 3; k++)
		if (self->cache[k])
			n += self->cache[k]->arena_size;
	return PyLong_FromSize_t(n);
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
	engine_release_all(self);
	Py_RETURN_NONE;
}

static PyObject *Engine_enter(PyObject *self, PyObject *unused)
{
	return Py_NewRef(self);
}

static PyObject *Engine_exit(EngineObject *self, PyObject *args)
{
	engine_release_all(self);
	Py_RETURN_FALSE;
}

/* ------------------------------------------------------------------ */
/* shared open logic                                                   */

struct opened {
	int fd;
	int direct;
	int kind;
	uint64_t size;	  /* st_size at open (readers) */
	PyObject *reason; /* why not uring / not O_DIRECT, or NULL */
	PyObject *path;	  /* fspath(path) */
};

/*
 * Close fd once and mark it closed. Returns 0 or the errno of close(); the
 * fd is gone either way (Linux releases it even on EINTR), so never retry.
 */
static int close_fd(int *fd)
{
	int err = 0;

	if (*fd >= 0 && close(*fd))
		err = errno;
	*fd = -1;
	return err;
}

/*
 * open(2) retried on EINTR. With *direct set, try O_DIRECT first and fall
 * back to buffered when the filesystem refuses it (EINVAL), clearing *direct
 * and saying why. Returns the fd or -errno. Runs without the GIL.
 */
static int open_fd(const char *cpath, int flags, int *direct, char *why, size_t whylen)
{
	int fd;

	if (*direct) {
		do {
			fd = open(cpath, flags | O_DIRECT, 0644);
		} while (fd < 0 && errno == EINTR);
		if (fd >= 0)
			return fd;
		if (errno != EINVAL)
			return -errno;
		*direct = 0;
		snprintf(why, whylen, "O_DIRECT refused by the filesystem (open: EINVAL)");
	}
	do {
		fd = open(cpath, flags, 0644);
	} while (fd < 0 && errno == EINTR);
	return fd >= 0 ? fd : -errno;
}

static void opened_release(struct opened *o)
{
	close_fd(&o->fd);
	Py_CLEAR(o->path);
	Py_CLEAR(o->reason);
}

/* How open_file opens a path. */
enum open_mode {
	OPEN_READ,
	/*
	 * A new file: O_EXCL | O_NOFOLLOW, so a name that exists (a file, or a
	 * symlink planted where a temporary will be created) is refused with
	 * EEXIST / ELOOP instead of being truncated or written through.
	 */
	OPEN_CREATE,
	/* A file that exists already (e.g. /proc/self/fd/N of an O_TMPFILE file): no create, no truncate. */
	OPEN_EXISTING,
};

/*
 * Open path for an engine: O_DIRECT when asked (buffered fallback), pick the
 * engine kind for the file and, for readers, its size. On failure raise
 * OSError(errno, strerror, path) and leave nothing open.
 */
static int open_file(EngineObject *eng, PyObject *path_arg, enum open_mode mode, struct opened *o)
{
	int writing = mode != OPEN_READ;
	int flags = mode == OPEN_CREATE	  ? O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC :
		    mode == OPEN_EXISTING ? O_WRONLY | O_CLOEXEC :
					    O_RDONLY | O_CLOEXEC;
	int direct = eng->direct, refused = 0, fd, err = 0;
	PyObject *bytes = NULL;
	char why[200] = "";
	struct stat st;

	memset(o, 0, sizeof(*o));
	o->fd = -1;
	o->path = PyOS_FSPath(path_arg);
	if (!o->path)
		return -1;
	if (!PyUnicode_FSConverter(o->path, &bytes))
		goto fail;
	if (direct && NIO_FAULT(refuse_direct)) {
		direct = 0;
		snprintf(why, sizeof(why),
			 "O_DIRECT refused by the filesystem (simulated by _inject_faults)");
	}
	Py_BEGIN_ALLOW_THREADS
	fd = open_fd(PyBytes_AS_STRING(bytes), flags, &direct, why, sizeof(why));
	if (fd >= 0 && !writing && fstat(fd, &st))
		err = errno;
	Py_END_ALLOW_THREADS
	Py_DECREF(bytes);
	if (fd < 0) {
		errno = -fd;
		goto fail_errno;
	}
	o->fd = fd;
	if (err) {
		errno = err;
		goto fail_errno;
	}
	o->size = writing ? 0 : (uint64_t)st.st_size;
	o->direct = direct;
	refused = eng->direct && !direct;
	o->kind = eng->kind;
	if (eng->kind == NIO_URING && !o->direct && eng->requested == 0) {
		/* auto: buffered files go through the portable engine */
		o->kind = NIO_PORTABLE;
		if (!refused)
			snprintf(why, sizeof(why),
				 "direct=False: buffered I/O uses the portable engine");
	}
	if (eng->kind == NIO_PORTABLE && eng->fallback_reason && !refused) {
		o->reason = Py_NewRef(eng->fallback_reason);
	} else if (why[0]) {
		o->reason = PyUnicode_FromString(why);
		if (!o->reason)
			goto fail;
	}
	return 0;
fail_errno:
	PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, o->path);
fail:
	opened_release(o);
	return -1;
}

/* A CRC-32C argument (crc=, value=): NULL (not given) leaves *out; else it must fit in 32 bits. */
static int parse_u32(PyObject *obj, const char *what, uint32_t *out)
{
	unsigned long long v;

	if (!obj)
		return 0;
	v = PyLong_AsUnsignedLongLong(obj);
	if (v == (unsigned long long)-1 && PyErr_Occurred())
		return -1;
	if (v > 0xffffffffull) {
		PyErr_Format(PyExc_ValueError, "%s must fit in 32 bits", what);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

/* ------------------------------------------------------------------ */
/* segment parsing                                                     */

struct segs {
	Py_ssize_t n;
	Py_buffer *views;
	uint64_t *offs;
	uint32_t *crcs;
	Py_ssize_t nheld;
};

static void segs_release(struct segs *S)
{
	for (Py_ssize_t i = 0; i < S->nheld; i++)
		PyBuffer_Release(&S->views[i]);
	S->nheld = 0;
	PyMem_Free(S->views);
	PyMem_Free(S->offs);
	PyMem_Free(S->crcs);
	S->views = NULL;
	S->offs = NULL;
	S->crcs = NULL;
}

/* Parse [(offset, buffer), ...]; writers check order against *end. */
static int segs_parse(PyObject *segments, int writable, uint64_t *end, struct segs *S)
{
	PyObject *seq;
	uint64_t prev = end ? *end : 0;

	memset(S, 0, sizeof(*S));
	seq = PySequence_Fast(segments, "segments must be a sequence of (offset, buffer) pairs");
	if (!seq)
		return -1;
	S->n = PySequence_Fast_GET_SIZE(seq);
	S->views = PyMem_Calloc(S->n ? S->n : 1, sizeof(Py_buffer));
	S->offs = PyMem_Calloc(S->n ? S->n : 1, sizeof(uint64_t));
	S->crcs = PyMem_Calloc(S->n ? S->n : 1, sizeof(uint32_t));
	if (!S->views || !S->offs || !S->crcs) {
		PyErr_NoMemory();
		goto fail;
	}
	for (Py_ssize_t i = 0; i < S->n; i++) {
		PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
		PyObject *pair, *o;
		unsigned long long off;
		int rc;

		pair = PySequence_Fast(item, "each segment must be an (offset, buffer) pair");
		if (!pair)
			goto fail;
		if (PySequence_Fast_GET_SIZE(pair) != 2) {
			Py_DECREF(pair);
			PyErr_Format(PyExc_TypeError,
				     "segment %zd: expected an (offset, buffer) pair", i);
			goto fail;
		}
		o = PySequence_Fast_GET_ITEM(pair, 0);
		if (!PyLong_Check(o) && !PyIndex_Check(o)) {
			Py_DECREF(pair);
			PyErr_Format(PyExc_TypeError, "segment %zd: offset must be an int", i);
			goto fail;
		}
		{
			PyObject *idx = PyNumber_Index(o);

			if (!idx) {
				Py_DECREF(pair);
				goto fail;
			}
			off = PyLong_AsUnsignedLongLong(idx);
			Py_DECREF(idx);
			if (off == (unsigned long long)-1 && PyErr_Occurred()) {
				Py_DECREF(pair);
				PyErr_Format(
					PyExc_ValueError,
					"segment %zd: offset must be a non-negative int below 2**63",
					i);
				goto fail;
			}
			if (off > (unsigned long long)INT64_MAX) {
				Py_DECREF(pair);
				PyErr_Format(PyExc_ValueError, "segment %zd: offset too large", i);
				goto fail;
			}
		}
		rc = PyObject_GetBuffer(PySequence_Fast_GET_ITEM(pair, 1), &S->views[i],
					writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
		Py_DECREF(pair);
		if (rc < 0)
			goto fail;
		S->nheld = i + 1;
		S->offs[i] = off;
		if ((uint64_t)S->views[i].len > (uint64_t)INT64_MAX - off) {
			PyErr_Format(PyExc_ValueError, "segment %zd: offset + length overflows", i);
			goto fail;
		}
		if (end) {
			if (off < prev) {
				PyErr_Format(
					PyExc_ValueError,
					"segment %zd: offset %llu is before the end of the previous data (%llu); offsets must be increasing and non-overlapping",
					i, off, (unsigned long long)prev);
				goto fail;
			}
			prev = off + (uint64_t)S->views[i].len;
		}
	}
	Py_DECREF(seq);
	return 0;
fail:
	Py_DECREF(seq);
	segs_release(S);
	return -1;
}

static PyObject *crc_list(struct segs *S)
{
	PyObject *list = PyList_New(S->n);

	if (!list)
		return NULL;
	for (Py_ssize_t i = 0; i < S->n; i++) {
		PyObject *v = PyLong_FromUnsignedLong(S->crcs[i]);

		if (!v) {
			Py_DECREF(list);
			return NULL;
		}
		PyList_SET_ITEM(list, i, v);
	}
	return list;
}

/* ------------------------------------------------------------------ */
/* Writer                                                              */

typedef struct {
	PyObject_HEAD
	EngineObject *eng;
	struct nio_ctx *ctx;
	struct nio_writer w;
	int fd;
	char direct; /* char: T_BOOL members */
	char closed;
	int kind;
	int busy;
	int failed;	  /* errno of the failure that poisoned it */
	int prealloc_err; /* errno of a refused preallocation (size_hint), 0 = none */
	double seconds;
	size_t unstaged_min; /* write(): congruent segments with an aligned body this large go unstaged */
	/*
	 * write(..., wait=False): buffers that transfers still in flight may
	 * read, oldest first, each with the submission count after which it is
	 * free (released once w.retired reaches it).
	 */
	Py_buffer *held;
	uint64_t *held_until;
	Py_ssize_t held_head, held_n, held_cap;
	PyObject *path;
	PyObject *reason;
} WriterObject;

static int fork_check(struct nio_ctx *ctx, const char *what)
{
	if (ctx && ctx->pid != getpid()) {
		PyErr_Format(
			PyExc_RuntimeError,
			"native_io: this %s was opened in another process (fork); open it again here",
			what);
		return -1;
	}
	return 0;
}

static int busy_check(int busy, int closed, const char *what)
{
	if (busy) {
		PyErr_Format(PyExc_RuntimeError, "native_io: %s is in use by another thread", what);
		return -1;
	}
	if (closed) {
		PyErr_Format(PyExc_ValueError, "I/O operation on a closed %s", what);
		return -1;
	}
	return 0;
}

/* Release the held buffers no transfer reads any more (all of them: every one). Needs the GIL. */
static void writer_release_held(WriterObject *self, int every)
{
	while (self->held_head < self->held_n &&
	       (every || self->held_until[self->held_head] <= self->w.retired))
		PyBuffer_Release(&self->held[self->held_head++]);
	if (self->held_head == self->held_n)
		self->held_head = self->held_n = 0;
}

/* Keep S's buffers (moved, not copied: S releases none of them) until the transfers so far are done. */
static int writer_hold(WriterObject *self, struct segs *S)
{
	Py_ssize_t need = self->held_n + S->nheld;

	if (need > self->held_cap) {
		Py_ssize_t cap = need > 2 * self->held_cap ? need : 2 * self->held_cap;
		Py_buffer *v = PyMem_Realloc(self->held, (size_t)cap * sizeof(Py_buffer));
		uint64_t *u;

		if (!v)
			return -1;
		self->held = v;
		u = PyMem_Realloc(self->held_until, (size_t)cap * sizeof(uint64_t));
		if (!u)
			return -1;
		self->held_until = u;
		self->held_cap = cap;
	}
	for (Py_ssize_t i = 0; i < S->nheld; i++) {
		self->held[self->held_n] = S->views[i];
		self->held_until[self->held_n++] = self->w.submits;
	}
	S->nheld = 0;
	return 0;
}

static PyObject *Engine_open_writer(EngineObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "path", "size_hint", "existing", NULL };
	PyObject *path, *hint_obj = Py_None;
	unsigned long long hint = 0;
	int existing = 0;
	struct opened o;
	WriterObject *w;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O$p", kwlist, &path, &hint_obj, &existing))
		return NULL;
	if (hint_obj != Py_None) {
		hint = PyLong_AsUnsignedLongLong(hint_obj);
		if (hint == (unsigned long long)-1 && PyErr_Occurred())
			return NULL;
		if (hint > (unsigned long long)INT64_MAX) {
			PyErr_SetString(PyExc_ValueError, "size_hint too large");
			return NULL;
		}
	}
	if (open_file(self, path, existing ? OPEN_EXISTING : OPEN_CREATE, &o))
		return NULL;
	w = PyObject_New(WriterObject, &WriterType);
	if (!w) {
		opened_release(&o);
		return NULL;
	}
	/* the writer owns the fd and references from here on */
	w->eng = (EngineObject *)Py_NewRef(self);
	w->fd = o.fd;
	w->direct = (char)o.direct;
	w->kind = o.kind;
	w->closed = 0;
	w->busy = 0;
	w->failed = 0;
	w->prealloc_err = 0;
	w->seconds = 0;
	/* 0 copies everything: faster where the device splits transfers from plain pages */
	w->unstaged_min = w->direct && nio_device_splits_pages(o.fd) ? 0 : NIO_UNSTAGED_MIN;
	w->held = NULL;
	w->held_until = NULL;
	w->held_head = w->held_n = w->held_cap = 0;
	w->path = o.path;
	w->reason = o.reason;
	w->ctx = engine_take_ctx(self, o.kind);
	if (!w->ctx) {
		close_fd(&w->fd);
		w->closed = 1;
		Py_DECREF(w);
		return NULL;
	}
	nio_writer_init(&w->w, w->ctx, w->fd, w->direct, self->stall_ms);
	if (hint) {
		Py_BEGIN_ALLOW_THREADS
		w->prealloc_err = nio_writer_preallocate(&w->w, hint);
		Py_END_ALLOW_THREADS
	}
	return (PyObject *)w;
}

/* Close without syncing: drain, close the fd, give the context back. */
static void writer_discard(WriterObject *self)
{
	if (self->closed)
		return;
	if (self->ctx && self->ctx->pid == getpid()) {
		Py_BEGIN_ALLOW_THREADS
		nio_writer_abort(&self->w);
		Py_END_ALLOW_THREADS
		engine_return_ctx(self->eng, self->ctx);
		self->ctx = NULL;
	}
	close_fd(&self->fd);
	self->closed = 1;
	writer_release_held(self, 1);
}

/*
 * write(segments, wait=True). wait=False returns without waiting for the
 * transfers that read segments straight from their buffers (see
 * unstaged_min): the writer keeps those buffers until the transfers are
 * done, at the latest until close(), so that the queue stays full from one
 * call to the next. Their bytes must not change until then.
 */
static PyObject *Writer_write(WriterObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "segments", "wait", NULL };
	struct nio_error e = { 0 };
	PyObject *segments;
	struct segs S;
	PyObject *res;
	int rc = 0, wait = 1;
	int in_flight = 0; /* unstaged transfers read the callers' buffers */

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &segments, &wait))
		return NULL;
	if (busy_check(self->busy, self->closed, "writer") || fork_check(self->ctx, "writer"))
		return NULL;
	if (self->failed)
		return raise_io(self->failed, self->path, "write", 0, 0,
				"an earlier write failed; close the writer");
	if (segs_parse(segments, 0, &self->w.end, &S))
		return NULL;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	double t0 = now();

	for (Py_ssize_t i = 0; i < S.n; i++) {
		rc = nio_writer_put_auto(&self->w, S.offs[i], S.views[i].buf,
					 (size_t)S.views[i].len, self->unstaged_min, &S.crcs[i],
					 &in_flight, &e);
		if (rc)
			break;
	}
	/* before the buffers are released; or every transfer that reads them in flight, to hold them */
	if (!rc && in_flight)
		rc = wait ? nio_writer_wait_all(&self->w, &e) :
			    nio_writer_release_user(&self->w, &e);
	if (rc)
		nio_writer_abort(&self->w);
	self->seconds += now() - t0;
	Py_END_ALLOW_THREADS
	self->busy = 0;
	writer_release_held(self, 0);
	if (rc) {
		segs_release(&S);
		self->failed = e.err ? e.err : EIO;
		return raise_nio(&e, self->path);
	}
	res = crc_list(&S);
	if (res && in_flight && self->w.retired < self->w.submits && writer_hold(self, &S)) {
		/* cannot keep the buffers: wait for the transfers instead */
		Py_BEGIN_ALLOW_THREADS
		rc = nio_writer_wait_all(&self->w, &e);
		if (rc)
			nio_writer_abort(&self->w);
		Py_END_ALLOW_THREADS
		writer_release_held(self, 0);
		PyErr_Clear();
		if (rc) {
			Py_DECREF(res);
			segs_release(&S);
			self->failed = e.err ? e.err : EIO;
			return raise_nio(&e, self->path);
		}
	}
	segs_release(&S);
	return res;
}

/*
 * write_unstaged(offset, buffer, crc=None): one segment written straight
 * from the caller's memory when the writer is O_DIRECT and buffer and offset
 * are ALIGN-aligned (else staged like write()). Returns once the buffer is no
 * longer read, so the caller may reuse it. Saves the copy into the arena for
 * callers that own an aligned buffer already (the async saver's staging ring).
 */
static PyObject *Writer_write_unstaged(WriterObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "offset", "buffer", "crc", NULL };
	unsigned long long off;
	PyObject *buf_obj, *crc_obj = Py_None;
	struct nio_error e = { 0 };
	Py_buffer view;
	uint32_t crc = 0;
	int have_crc = 0, unstaged, rc;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "KO|O", kwlist, &off, &buf_obj, &crc_obj))
		return NULL;
	have_crc = crc_obj != Py_None;
	if (have_crc && parse_u32(crc_obj, "crc", &crc))
		return NULL;
	if (off > (unsigned long long)INT64_MAX) {
		PyErr_SetString(PyExc_ValueError, "offset too large");
		return NULL;
	}
	if (busy_check(self->busy, self->closed, "writer") || fork_check(self->ctx, "writer"))
		return NULL;
	if (self->failed)
		return raise_io(self->failed, self->path, "write", 0, 0,
				"an earlier write failed; close the writer");
	if (PyObject_GetBuffer(buf_obj, &view, PyBUF_SIMPLE) < 0)
		return NULL;
	if ((uint64_t)view.len > (uint64_t)INT64_MAX - off) {
		PyBuffer_Release(&view);
		PyErr_SetString(PyExc_ValueError, "offset + length overflows");
		return NULL;
	}
	if (off < self->w.end) {
		PyBuffer_Release(&view);
		return PyErr_Format(
			PyExc_ValueError,
			"offset %llu is before the end of the previous data (%llu); offsets must be increasing and non-overlapping",
			off, (unsigned long long)self->w.end);
	}
	unstaged = self->direct && off % NIO_ALIGN == 0 && (uintptr_t)view.buf % NIO_ALIGN == 0;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	double t0 = now();

	if (unstaged) {
		rc = nio_writer_put_unstaged(&self->w, off, view.buf, (size_t)view.len, have_crc,
					     &crc, &e);
	} else {
		uint32_t staged_crc;

		rc = nio_writer_put(&self->w, off, view.buf, (size_t)view.len, &staged_crc, &e);
		if (!have_crc)
			crc = staged_crc;
	}
	if (rc)
		nio_writer_abort(&self->w);
	self->seconds += now() - t0;
	Py_END_ALLOW_THREADS
	self->busy = 0;
	writer_release_held(self, 0);
	PyBuffer_Release(&view);
	if (rc) {
		self->failed = e.err ? e.err : EIO;
		return raise_nio(&e, self->path);
	}
	return PyLong_FromUnsignedLong(crc);
}

static PyObject *Writer_close(WriterObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "size", NULL };
	PyObject *size_obj = Py_None;
	unsigned long long size = 0;
	struct nio_error e = { 0 };
	int have_size = 0, rc = 0, err;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &size_obj))
		return NULL;
	if (self->closed)
		Py_RETURN_NONE;
	if (busy_check(self->busy, 0, "writer") || fork_check(self->ctx, "writer"))
		return NULL;
	if (size_obj != Py_None) {
		size = PyLong_AsUnsignedLongLong(size_obj);
		if (size == (unsigned long long)-1 && PyErr_Occurred())
			return NULL;
		if (size > (unsigned long long)INT64_MAX) {
			PyErr_SetString(PyExc_ValueError, "size too large");
			return NULL;
		}
		have_size = 1;
	}
	if (self->failed) {
		/* the file is garbage anyway: release without syncing */
		writer_discard(self);
		Py_RETURN_NONE;
	}
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	double t0 = now();

	rc = nio_writer_finish(&self->w, have_size, size, &e);
	if (rc)
		nio_writer_abort(&self->w);
	err = close_fd(&self->fd);
	if (err && !rc) {
		rc = -1;
		e.err = err;
		e.op = "close";
		e.has_off = 0;
	}
	self->seconds += now() - t0;
	Py_END_ALLOW_THREADS
	self->busy = 0;
	self->closed = 1;
	engine_return_ctx(self->eng, self->ctx);
	self->ctx = NULL;
	writer_release_held(self, 1); /* finished or aborted: nothing in flight */
	if (rc) {
		self->failed = e.err ? e.err : EIO;
		return raise_nio(&e, self->path);
	}
	Py_RETURN_NONE;
}

static PyObject *Writer_enter(PyObject *self, PyObject *unused)
{
	return Py_NewRef(self);
}

static PyObject *Writer_exit(WriterObject *self, PyObject *args)
{
	PyObject *et = Py_None, *ev = Py_None, *tb = Py_None, *r;

	if (!PyArg_UnpackTuple(args, "__exit__", 0, 3, &et, &ev, &tb))
		return NULL;
	if (et != Py_None) {
		if (!self->busy)
			writer_discard(self);
		Py_RETURN_FALSE;
	}
	{
		PyObject *noargs = PyTuple_New(0);

		if (!noargs)
			return NULL;
		r = Writer_close(self, noargs, NULL);
		Py_DECREF(noargs);
	}
	if (!r)
		return NULL;
	Py_DECREF(r);
	Py_RETURN_FALSE;
}

static void Writer_dealloc(WriterObject *self)
{
	if (!self->closed) {
		PyObject *et, *ev, *tb;

		/* unflushed data is dropped: say so, like an unclosed file */
		PyErr_Fetch(&et, &ev, &tb);
		/* no source object: self is being freed, it must not be kept */
		if (PyErr_WarnFormat(
			    PyExc_ResourceWarning, 1,
			    "native_io writer for %R was never closed; staged data discarded",
			    self->path ? self->path : Py_None) < 0)
			PyErr_WriteUnraisable((PyObject *)self);
		PyErr_Restore(et, ev, tb);
	}
	writer_discard(self);
	PyMem_Free(self->held);
	PyMem_Free(self->held_until);
	Py_CLEAR(self->eng);
	Py_CLEAR(self->path);
	Py_CLEAR(self->reason);
	PyObject_Free(self);
}

static PyObject *Writer_get_engine(WriterObject *self, void *c)
{
	return PyUnicode_FromString(kind_name(self->kind));
}

static PyObject *Writer_get_prealloc_error(WriterObject *self, void *c)
{
	if (!self->prealloc_err)
		Py_RETURN_NONE;
	return PyUnicode_FromFormat("fallocate: %s", strerror(self->prealloc_err));
}

/* ------------------------------------------------------------------ */
/* Reader                                                              */

typedef struct {
	PyObject_HEAD
	EngineObject *eng;
	struct nio_ctx *ctx;
	int fd;
	char direct; /* char: T_BOOL members */
	char closed;
	int kind;
	int busy;
	uint64_t size;
	uint64_t io_bytes;
	uint64_t to_dest_bytes;
	uint64_t payload;
	double seconds;
	size_t direct_min; /* read(): pieces this large may go straight into their buffers */
	PyObject *path;
	PyObject *reason;
} ReaderObject;

static PyObject *Engine_open_reader(EngineObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "path", NULL };
	PyObject *path;
	struct opened o;
	ReaderObject *r;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &path))
		return NULL;
	if (open_file(self, path, OPEN_READ, &o))
		return NULL;
	r = PyObject_New(ReaderObject, &ReaderType);
	if (!r) {
		opened_release(&o);
		return NULL;
	}
	/* the reader owns the fd and references from here on */
	r->eng = (EngineObject *)Py_NewRef(self);
	r->fd = o.fd;
	r->direct = (char)o.direct;
	r->kind = o.kind;
	r->closed = 0;
	r->busy = 0;
	r->size = o.size;
	r->io_bytes = 0;
	r->to_dest_bytes = 0;
	r->payload = 0;
	r->seconds = 0;
	/* through the arena (huge pages) where the device splits transfers into plain pages */
	r->direct_min = r->direct && nio_device_splits_pages(o.fd) ? SIZE_MAX : NIO_READ_DIRECT_MIN;
	r->path = o.path;
	r->reason = o.reason;
	r->ctx = engine_take_ctx(self, o.kind);
	if (!r->ctx) {
		close_fd(&r->fd);
		r->closed = 1;
		Py_DECREF(r);
		return NULL;
	}
	return (PyObject *)r;
}

static PyObject *reader_read(ReaderObject *self, PyObject *segments, PyObject *progress)
{
	struct nio_error e = { 0 };
	struct nio_rseg *rs;
	struct segs S;
	struct stat st;
	PyObject *res;
	uint64_t io = 0;
	int rc;

	if (busy_check(self->busy, self->closed, "reader") || fork_check(self->ctx, "reader"))
		return NULL;
	if (segs_parse(segments, 1, NULL, &S))
		return NULL;
	if (fstat(self->fd, &st)) {
		segs_release(&S);
		return raise_io(errno, self->path, "fstat", 0, 0, NULL);
	}
	self->size = (uint64_t)st.st_size;
	for (Py_ssize_t i = 0; i < S.n; i++) {
		uint64_t end = S.offs[i] + (uint64_t)S.views[i].len;
		char detail[160];

		if (end > self->size) {
			snprintf(
				detail, sizeof(detail),
				"segment of %zd bytes ends at %llu but the file has %llu bytes; truncated file?",
				S.views[i].len, (unsigned long long)end,
				(unsigned long long)self->size);
			uint64_t at = S.offs[i] > self->size ? S.offs[i] : self->size;

			segs_release(&S);
			return raise_io(ENODATA, self->path, "read past end of file", 1, at,
					detail);
		}
	}
	rs = PyMem_Calloc(S.n ? S.n : 1, sizeof(*rs));
	if (!rs) {
		segs_release(&S);
		return PyErr_NoMemory();
	}
	for (Py_ssize_t i = 0; i < S.n; i++) {
		rs[i].off = S.offs[i];
		rs[i].buf = S.views[i].buf;
		rs[i].len = (size_t)S.views[i].len;
	}
	if (progress && read_progress_begin(progress, (size_t)S.n)) {
		PyMem_Free(rs);
		segs_release(&S);
		return NULL;
	}
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	double t0 = now();

	rc = nio_read_segments(self->ctx, self->fd, self->direct, self->direct_min, self->size, rs,
			       (size_t)S.n, &io, &self->to_dest_bytes,
			       progress ? read_progress_update : NULL, progress, &e);
	self->seconds += now() - t0;
	Py_END_ALLOW_THREADS
	self->busy = 0;
	self->io_bytes += io;
	for (Py_ssize_t i = 0; i < S.n; i++) {
		S.crcs[i] = rs[i].crc;
		self->payload += rs[i].len;
	}
	PyMem_Free(rs);
	if (rc) {
		segs_release(&S);
		if (self->ctx->broken) {
			engine_return_ctx(self->eng, self->ctx);
			self->ctx = NULL;
			close_fd(&self->fd);
			self->closed = 1;
		}
		if (e.err == ENODATA)
			return raise_io(ENODATA, self->path, "read past end of file", 1, e.off,
					"file shrank while reading");
		return raise_nio(&e, self->path);
	}
	res = crc_list(&S);
	segs_release(&S);
	return res;
}

static PyObject *Reader_read(ReaderObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "segments", "progress", NULL };
	PyObject *segments, *progress = Py_None, *res;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &segments, &progress))
		return NULL;
	if (progress == Py_None)
		return reader_read(self, segments, NULL);
	if (read_progress_check(progress))
		return NULL;
	res = reader_read(self, segments, progress);
	/* on every outcome: its waiters must not wait for a read that failed */
	read_progress_end(progress);
	return res;
}

static PyObject *Reader_new_progress(ReaderObject *self, PyObject *unused)
{
	return PyObject_CallNoArgs((PyObject *)&ReadProgressType);
}

static PyObject *Reader_close(ReaderObject *self, PyObject *unused)
{
	int err;

	if (self->closed)
		Py_RETURN_NONE;
	if (busy_check(self->busy, 0, "reader"))
		return NULL;
	engine_return_ctx(self->eng, self->ctx);
	self->ctx = NULL;
	self->closed = 1;
	err = close_fd(&self->fd);
	if (err)
		return raise_io(err, self->path, "close", 0, 0, NULL);
	Py_RETURN_NONE;
}

static PyObject *Reader_exit(ReaderObject *self, PyObject *args)
{
	PyObject *r;

	if (self->busy)
		Py_RETURN_FALSE;
	r = Reader_close(self, NULL);
	if (!r)
		return NULL;
	Py_DECREF(r);
	Py_RETURN_FALSE;
}

static void Reader_dealloc(ReaderObject *self)
{
	if (!self->closed) {
		engine_return_ctx(self->eng, self->ctx);
		close_fd(&self->fd);
	}
	Py_CLEAR(self->eng);
	Py_CLEAR(self->path);
	Py_CLEAR(self->reason);
	PyObject_Free(self);
}

static PyObject *Reader_get_engine(ReaderObject *self, void *c)
{
	return PyUnicode_FromString(kind_name(self->kind));
}

/* ------------------------------------------------------------------ */
/* module functions                                                    */

static PyObject *mod_crc32c(PyObject *m, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "buf", "value", NULL };
	uint32_t value = 0, crc;
	PyObject *obj, *vobj = NULL;
	Py_buffer view;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &obj, &vobj))
		return NULL;
	if (parse_u32(vobj, "value", &value))
		return NULL;
	if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
		return NULL;
	if (view.len >= 65536) {
		Py_BEGIN_ALLOW_THREADS
		crc = nio_crc32c(value, view.buf, (size_t)view.len);
		Py_END_ALLOW_THREADS
	} else {
		crc = nio_crc32c(value, view.buf, (size_t)view.len);
	}
	PyBuffer_Release(&view);
	return PyLong_FromUnsignedLong(crc);
}

/*
 * copy_crc32c(dst, src, value=0): copy src into dst (same length) and return
 * src's CRC-32C, in one pass and without the GIL. The async saver's copier
 * uses it to snapshot tensors into its staging ring on one core.
 */
static PyObject *mod_copy_crc32c(PyObject *m, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "dst", "src", "value", NULL };
	uint32_t value = 0, crc;
	PyObject *dst_obj, *src_obj, *vobj = NULL;
	Py_buffer dst, src;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O", kwlist, &dst_obj, &src_obj, &vobj))
		return NULL;
	if (parse_u32(vobj, "value", &value))
		return NULL;
	if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0)
		return NULL;
	if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) {
		PyBuffer_Release(&dst);
		return NULL;
	}
	if (dst.len != src.len) {
		PyErr_Format(PyExc_ValueError, "dst has %zd bytes, src %zd: they must be equal",
			     dst.len, src.len);
		crc = 0;
	} else {
		Py_BEGIN_ALLOW_THREADS
		crc = nio_crc32c_copy(dst.buf, src.buf, (size_t)src.len, value);
		Py_END_ALLOW_THREADS
	}
	PyBuffer_Release(&src);
	PyBuffer_Release(&dst);
	if (PyErr_Occurred())
		return NULL;
	return PyLong_FromUnsignedLong(crc);
}

/*
 * reserve(fd, offset, length): fallocate mode 0 without the GIL: the range is
 * allocated and the file's size grows to cover it. OSError with the errno
 * where the filesystem refuses (EOPNOTSUPP, ENOSPC, EFBIG, ...).
 */
static PyObject *mod_reserve(PyObject *m, PyObject *args)
{
	int fd, err;
	long long off, len;

	if (!PyArg_ParseTuple(args, "iLL", &fd, &off, &len))
		return NULL;
	if (fd < 0 || off < 0 || len <= 0) {
		PyErr_SetString(
			PyExc_ValueError,
			"reserve(fd, offset, length): fd and offset must be >= 0, length > 0");
		return NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	err = nio_reserve(fd, (uint64_t)off, (uint64_t)len);
	Py_END_ALLOW_THREADS
	if (err) {
		errno = err;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	Py_RETURN_NONE;
}

static int dict_set(PyObject *d, const char *k, PyObject *v)
{
	int rc;

	if (!v)
		return -1;
	rc = PyDict_SetItemString(d, k, v);
	Py_DECREF(v);
	return rc;
}

static PyObject *mod_info(PyObject *m, PyObject *unused)
{
	const char *why = NULL;
	int usable = uring_usable(&why);
	const char *ver = nio_uring_version();
	PyObject *d = PyDict_New(), *engines;

	if (!d)
		return NULL;
	engines = nio_uring_compiled() ? Py_BuildValue("[ss]", "uring", "portable") :
					 Py_BuildValue("[s]", "portable");
	if (dict_set(d, "engines", engines) ||
	    dict_set(d, "default_engine", PyUnicode_FromString(usable ? "uring" : "portable")) ||
	    dict_set(d, "liburing", ver ? PyUnicode_FromString(ver) : Py_NewRef(Py_None)) ||
	    dict_set(d, "liburing_compiled", PyBool_FromLong(nio_uring_compiled())) ||
	    dict_set(d, "uring_usable", PyBool_FromLong(usable)) ||
	    dict_set(d, "uring_refused_reason",
		     why ? PyUnicode_FromString(why) : Py_NewRef(Py_None)) ||
	    dict_set(d, "default_block_size", PyLong_FromUnsignedLong(NIO_DEFAULT_BLOCK)) ||
	    dict_set(d, "default_queue_depth", PyLong_FromUnsignedLong(NIO_DEFAULT_QD)) ||
	    dict_set(d, "crc32c", PyUnicode_FromString(nio_crc32c_impl())) ||
	    dict_set(d, "align", PyLong_FromUnsignedLong(NIO_ALIGN)) ||
	    dict_set(d, "testing", PyBool_FromLong(NIO_TESTING_BUILD))) {
		Py_DECREF(d);
		return NULL;
	}
	return d;
}

#ifdef NATIVE_IO_TESTING
static PyObject *mod_inject(PyObject *m, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "short_every",   "eintr_every",  "eio_at",	       "stall_at",
				  "refuse_direct", "refuse_uring", "refuse_fallocate", NULL };
	long s = 0, i = 0, e = 0, st = 0;
	int rd = 0, ru = 0, rf = 0;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "|llllppp", kwlist, &s, &i, &e, &st, &rd, &ru,
					 &rf))
		return NULL;
	if (s < 0 || i < 0 || e < 0 || st < 0) {
		PyErr_SetString(PyExc_ValueError, "fault counts must be >= 0");
		return NULL;
	}
	nio_faults_set(s, i, e, st, rd, ru, rf);
	Py_RETURN_NONE;
}
#endif /* NATIVE_IO_TESTING */

/* ------------------------------------------------------------------ */
/* type tables                                                         */

/* Plain fields are members; PyGetSetDef only for computed values. */
static PyMemberDef Engine_members[] = {
	{ "block_size", T_ULONGLONG, offsetof(EngineObject, block_size), READONLY,
	  "bytes per transfer" },
	{ "queue_depth", T_UINT, offsetof(EngineObject, qd), READONLY, "transfers in flight" },
	{ "direct", T_BOOL, offsetof(EngineObject, direct), READONLY, "O_DIRECT requested" },
	{ "fallback_reason", T_OBJECT, offsetof(EngineObject, fallback_reason), READONLY,
	  "why uring is not used (auto), or None" },
	{ NULL },
};

static PyObject *Engine_get_completion_timeout(EngineObject *self, void *closure)
{
	return PyFloat_FromDouble(self->stall_ms / 1000.0);
}

static PyGetSetDef Engine_getset[] = {
	{ "completion_timeout", (getter)Engine_get_completion_timeout, NULL,
	  "seconds a writer waits for the next completion before it fails (0: no bound)", NULL },
	{ "engine", (getter)Engine_get_engine, NULL, "engine in use: 'uring' or 'portable'", NULL },
	{ "arena_bytes", (getter)Engine_get_arena_bytes, NULL, "bytes of idle staging arena held",
	  NULL },
	{ NULL },
};

static PyMethodDef Engine_methods[] = {
	{ "open_writer", (PyCFunction)(void (*)(void))Engine_open_writer,
	  METH_VARARGS | METH_KEYWORDS,
	  "open_writer(path, size_hint=None, *, existing=False) -> Writer: create path, a new file "
	  "(O_EXCL | O_NOFOLLOW: an existing name or a symlink is refused); existing=True opens a "
	  "file that exists (e.g. /proc/self/fd/N of an O_TMPFILE file) and creates none; "
	  "size_hint: expected file size, reserved with fallocate before the first write" },
	{ "open_reader", (PyCFunction)(void (*)(void))Engine_open_reader,
	  METH_VARARGS | METH_KEYWORDS, "open_reader(path) -> Reader" },
	{ "close", (PyCFunction)Engine_close, METH_NOARGS, "free the idle staging arenas" },
	{ "__enter__", Engine_enter, METH_NOARGS, NULL },
	{ "__exit__", (PyCFunction)Engine_exit, METH_VARARGS, NULL },
	{ NULL },
};

static PyMemberDef Writer_members[] = {
	{ "bytes_written", T_ULONGLONG, offsetof(WriterObject, w.payload), READONLY,
	  "payload bytes handed to write()" },
	{ "io_bytes", T_ULONGLONG, offsetof(WriterObject, w.io_bytes), READONLY,
	  "bytes transferred to the file (incl. padding)" },
	{ "unstaged_bytes", T_ULONGLONG, offsetof(WriterObject, w.unstaged), READONLY,
	  "payload bytes written straight from the caller's memory (write_unstaged, unstaged_min)" },
	{ "seconds", T_DOUBLE, offsetof(WriterObject, seconds), READONLY,
	  "wall time spent in write() and close()" },
	{ "direct", T_BOOL, offsetof(WriterObject, direct), READONLY,
	  "file is open with O_DIRECT" },
	{ "closed", T_BOOL, offsetof(WriterObject, closed), READONLY, NULL },
	{ "path", T_OBJECT, offsetof(WriterObject, path), READONLY, NULL },
	{ "fallback_reason", T_OBJECT, offsetof(WriterObject, reason), READONLY,
	  "why not uring/O_DIRECT, or None" },
	{ "preallocated", T_ULONGLONG, offsetof(WriterObject, w.reserved), READONLY,
	  "bytes reserved with fallocate at open (size_hint), 0 if none" },
	{ "end", T_ULONGLONG, offsetof(WriterObject, w.end), READONLY,
	  "end offset of the last segment" },
	{ NULL },
};

static PyObject *Writer_get_unstaged_min(WriterObject *self, void *closure)
{
	return PyLong_FromSize_t(self->unstaged_min);
}

/* A settable size attribute: *out = value (an int >= 0). */
static int set_size_attr(PyObject *value, const char *name, size_t *out)
{
	size_t n;

	if (!value) {
		PyErr_Format(PyExc_AttributeError, "%s cannot be deleted", name);
		return -1;
	}
	n = PyLong_AsSize_t(value);
	if (n == (size_t)-1 && PyErr_Occurred())
		return -1;
	*out = n;
	return 0;
}

static int Writer_set_unstaged_min(WriterObject *self, PyObject *value, void *closure)
{
	return set_size_attr(value, "unstaged_min", &self->unstaged_min);
}

static PyObject *Writer_get_held(WriterObject *self, void *closure)
{
	if (!self->busy)
		writer_release_held(self, 0);
	return PyLong_FromSsize_t(self->held_n - self->held_head);
}

static PyGetSetDef Writer_getset[] = {
	{ "held", (getter)Writer_get_held, NULL,
	  "buffers of write(..., wait=False) calls that transfers in flight may still read", NULL },
	{ "engine", (getter)Writer_get_engine, NULL, "engine used for this file", NULL },
	{ "unstaged_min", (getter)Writer_get_unstaged_min, (setter)Writer_set_unstaged_min,
	  "write(): on an O_DIRECT writer, a segment whose buffer address and file offset agree "
	  "modulo 4096 and whose aligned body is at least this many bytes is sent from its own "
	  "memory, not copied (0: always copy)",
	  NULL },
	{ "preallocate_error", (getter)Writer_get_prealloc_error, NULL,
	  "why open_writer(size_hint=...) reserved nothing (None when it did or was not asked)",
	  NULL },
	{ NULL },
};

static PyMethodDef Writer_methods[] = {
	{ "write", (PyCFunction)(void (*)(void))Writer_write, METH_VARARGS | METH_KEYWORDS,
	  "write(segments, wait=True) -> list[int]: write [(offset, buffer), ...] (staged, or from the buffer itself: see unstaged_min), return crc32c per segment once the buffers may be reused; wait=False: return at once, the writer keeps the buffers still being read (see held) and they must not change before close()" },
	{ "write_unstaged", (PyCFunction)(void (*)(void))Writer_write_unstaged,
	  METH_VARARGS | METH_KEYWORDS,
	  "write_unstaged(offset, buffer, crc=None) -> int: one segment, its aligned body written straight from buffer (O_DIRECT, buffer and offset 4096-aligned; else staged); returns its crc32c once buffer may be reused" },
	{ "close", (PyCFunction)(void (*)(void))Writer_close, METH_VARARGS | METH_KEYWORDS,
	  "close(size=None): flush, truncate, fdatasync, close (idempotent)" },
	{ "__enter__", Writer_enter, METH_NOARGS, NULL },
	{ "__exit__", (PyCFunction)Writer_exit, METH_VARARGS, NULL },
	{ NULL },
};

static PyMemberDef Reader_members[] = {
	{ "size", T_ULONGLONG, offsetof(ReaderObject, size), READONLY,
	  "file size (refreshed by read())" },
	{ "bytes_read", T_ULONGLONG, offsetof(ReaderObject, payload), READONLY,
	  "payload bytes delivered" },
	{ "io_bytes", T_ULONGLONG, offsetof(ReaderObject, io_bytes), READONLY,
	  "bytes transferred from the file" },
	{ "direct_bytes", T_ULONGLONG, offsetof(ReaderObject, to_dest_bytes), READONLY,
	  "bytes read straight into the destination buffers (not via the staging arena)" },
	{ "seconds", T_DOUBLE, offsetof(ReaderObject, seconds), READONLY,
	  "wall time spent in read()" },
	{ "direct", T_BOOL, offsetof(ReaderObject, direct), READONLY,
	  "file is open with O_DIRECT" },
	{ "closed", T_BOOL, offsetof(ReaderObject, closed), READONLY, NULL },
	{ "path", T_OBJECT, offsetof(ReaderObject, path), READONLY, NULL },
	{ "fallback_reason", T_OBJECT, offsetof(ReaderObject, reason), READONLY,
	  "why not uring/O_DIRECT, or None" },
	{ NULL },
};

static PyObject *Reader_get_direct_min(ReaderObject *self, void *closure)
{
	return PyLong_FromSize_t(self->direct_min);
}

static int Reader_set_direct_min(ReaderObject *self, PyObject *value, void *closure)
{
	return set_size_attr(value, "direct_min", &self->direct_min);
}

static PyGetSetDef Reader_getset[] = {
	{ "engine", (getter)Reader_get_engine, NULL, "engine used for this file", NULL },
	{ "direct_min", (getter)Reader_get_direct_min, (setter)Reader_set_direct_min,
	  "read(): a piece at least this large whose buffer and file offset agree modulo 4096 is read "
	  "straight into its buffer, the rest via the arena (default 256 KiB; on a device that splits "
	  "transfers into plain 4 KiB pages, everything via the arena's huge pages)",
	  NULL },
	{ NULL },
};

static PyMethodDef Reader_methods[] = {
	{ "read", (PyCFunction)(void (*)(void))Reader_read, METH_VARARGS | METH_KEYWORDS,
	  "read(segments, progress=None) -> list[int]: fill [(offset, writable buffer), ...], return "
	  "crc32c per segment; progress (a ReadProgress) reports the leading segments read to other "
	  "threads meanwhile" },
	{ "new_progress", (PyCFunction)Reader_new_progress, METH_NOARGS,
	  "new_progress() -> ReadProgress: a fresh one for read(..., progress=) (of this reader's build)" },
	{ "close", (PyCFunction)Reader_close, METH_NOARGS, "close (idempotent)" },
	{ "__enter__", Writer_enter, METH_NOARGS, NULL },
	{ "__exit__", (PyCFunction)Reader_exit, METH_VARARGS, NULL },
	{ NULL },
};

static PyTypeObject EngineType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_io.IOEngine",
	.tp_basicsize = sizeof(EngineObject),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc =
		"IOEngine(engine='auto', block_size=..., queue_depth=..., direct=True, "
		"completion_timeout=120.0)\n\ncompletion_timeout: the longest a writer waits for the next "
		"completion while transfers are in flight, in seconds (0: no bound); past it the write "
		"fails with ETIMEDOUT and the transfers are abandoned to the kernel. Reads are never "
		"abandoned: they land in the caller's memory.",
	.tp_new = PyType_GenericNew,
	.tp_init = (initproc)Engine_init,
	.tp_dealloc = (destructor)Engine_dealloc,
	.tp_methods = Engine_methods,
	.tp_members = Engine_members,
	.tp_getset = Engine_getset,
};

static PyTypeObject WriterType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_io.Writer",
	.tp_basicsize = sizeof(WriterObject),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "Coalescing writer; create with IOEngine.open_writer(path)",
	.tp_dealloc = (destructor)Writer_dealloc,
	.tp_methods = Writer_methods,
	.tp_members = Writer_members,
	.tp_getset = Writer_getset,
};

static PyTypeObject ReaderType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_io.Reader",
	.tp_basicsize = sizeof(ReaderObject),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "Extent reader; create with IOEngine.open_reader(path)",
	.tp_dealloc = (destructor)Reader_dealloc,
	.tp_methods = Reader_methods,
	.tp_members = Reader_members,
	.tp_getset = Reader_getset,
};

static PyMethodDef module_methods[] = {
	{ "crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
	  "crc32c(buf, value=0) -> int: CRC-32C (Castagnoli), chainable" },
	{ "copy_crc32c", (PyCFunction)(void (*)(void))mod_copy_crc32c, METH_VARARGS | METH_KEYWORDS,
	  "copy_crc32c(dst, src, value=0) -> int: copy src into dst (same length), return src's CRC-32C" },
	{ "reserve", (PyCFunction)mod_reserve, METH_VARARGS,
	  "reserve(fd, offset, length): allocate the range and grow the file's size to cover it (fallocate mode 0)" },
	{ "info", (PyCFunction)mod_info, METH_NOARGS,
	  "info() -> dict describing the build and defaults" },
#ifdef NATIVE_IO_TESTING
	{ "_inject_faults", (PyCFunction)(void (*)(void))mod_inject, METH_VARARGS | METH_KEYWORDS,
	  "_inject_faults(short_every=0, eintr_every=0, eio_at=0, stall_at=0, refuse_direct=False, "
	  "refuse_uring=False, refuse_fallocate=False)" },
#endif
	{ NULL },
};

static struct PyModuleDef moduledef = {
	PyModuleDef_HEAD_INIT,
	.m_name = NIO_MODULE_NAME,
	.m_doc = "Coalescing io_uring checkpoint I/O engine",
	.m_size = -1,
	.m_methods = module_methods,
};

PyMODINIT_FUNC NIO_PYINIT(void)
{
	PyObject *m;

	nio_crc32c_init();
	if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&WriterType) < 0 ||
	    PyType_Ready(&ReaderType) < 0 || PyType_Ready(&ReadProgressType) < 0 ||
	    PyType_Ready(&SpanType) < 0)
		return NULL;
	m = PyModule_Create(&moduledef);
	if (!m)
		return NULL;
	NativeIOError = PyErr_NewExceptionWithDoc(
		"native_io.NativeIOError",
		"OSError from native_io; .operation and .offset name the failing step",
		PyExc_OSError, NULL);
	if (!NativeIOError || PyModule_AddObjectRef(m, "NativeIOError", NativeIOError) < 0 ||
	    PyModule_AddObjectRef(m, "IOEngine", (PyObject *)&EngineType) < 0 ||
	    PyModule_AddObjectRef(m, "Writer", (PyObject *)&WriterType) < 0 ||
	    PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0 ||
	    PyModule_AddObjectRef(m, "ReadProgress", (PyObject *)&ReadProgressType) < 0 ||
	    PyModule_AddObjectRef(m, "Span", (PyObject *)&SpanType) < 0 ||
	    PyModule_AddIntConstant(m, "ALIGN", NIO_ALIGN) < 0 ||
	    PyModule_AddIntConstant(m, "DEFAULT_BLOCK_SIZE", NIO_DEFAULT_BLOCK) < 0 ||
	    PyModule_AddIntConstant(m, "DEFAULT_QUEUE_DEPTH", NIO_DEFAULT_QD) < 0) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
