/* SPDX-License-Identifier: Apache-2.0 */
/*
 * native_io: coalescing checkpoint I/O engine - shared declarations.
 *
 * Layering:
 *   crc32c.c          CRC-32C (SSE4.2 or table), fused copy+checksum
 *   arena.c           aligned staging arena + per-file I/O context lifecycle
 *   iocore.c          request state machine: requeue of short/EINTR/EAGAIN
 *                     results, fault injection, draining
 *   uring_engine.c    backend: io_uring via liburing
 *   portable_engine.c backend: pread/pwrite from a small thread pool
 *   writer.c/reader.c pure C writer/reader (no Python, run without the GIL)
 *   module.c          CPython glue
 */
#ifndef NATIVE_IO_NIO_H
#define NATIVE_IO_NIO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define NIO_ALIGN	    4096u
/*
 * default Writer.unstaged_min where the device does not split plain-page
 * transfers (elsewhere 0: copy everything; measured, docs/native_io.md)
 */
#define NIO_UNSTAGED_MIN    (2u << 20)
#define NIO_BUFFERED_MAX    (256u * 1024u) /* largest buffered pwrite */
#define NIO_MAX_BLOCK	    (1u << 30)	   /* kernel caps one rw at ~2 GiB */
#define NIO_MAX_QD	    64u
/*
 * A writer keeps up to qd blocks' worth of bytes in flight, in at most this
 * many transfers: uncopied tensor bodies can be much smaller than a block.
 */
#define NIO_WRITE_REQS	    32u
/* Pieces of one gathered write (IOV_MAX is 1024). */
#define NIO_MAX_IOV	    256
#define NIO_MAX_REQS	    (NIO_MAX_QD + 1 > NIO_WRITE_REQS ? NIO_MAX_QD + 1 : NIO_WRITE_REQS)
#define NIO_MAX_RETRIES	    1000	   /* EINTR/EAGAIN/no-progress cap */
#define NIO_READ_DIRECT_MIN (256u * 1024u) /* pieces read straight into dest */

/* Defaults chosen by measurement, see docs/native_io.md */
#define NIO_DEFAULT_BLOCK   (16u * 1024u * 1024u)
#define NIO_DEFAULT_QD	    2u
/*
 * Longest a writer waits for the next completion while transfers are in
 * flight before it fails with ETIMEDOUT: one block takes well under a second
 * on any working device, so this only ends a device or kernel that stopped
 * answering, which would otherwise hang the save (and the training) forever.
 */
#define NIO_STALL_LIMIT_MS  (120u * 1000u)

#define NIO_ALIGN_DOWN(x)   ((x) & ~((uint64_t)NIO_ALIGN - 1))
#define NIO_ALIGN_UP(x)	    (((x) + NIO_ALIGN - 1) & ~((uint64_t)NIO_ALIGN - 1))

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t nio_now_ns(void);

enum nio_kind { NIO_URING = 1, NIO_PORTABLE = 2 };
enum nio_op { NIO_OP_READ = 0, NIO_OP_WRITE = 1 };
enum nio_req_state { NIO_REQ_IDLE = 0, NIO_REQ_BUSY, NIO_REQ_DONE };

/*
 * One logical I/O: transfer [buf, buf+len) at file offset off, or, when
 * niov > 0, the len bytes of iov[0..niov) (a writer's gathered transfer).
 */
struct nio_req {
	int fd;
	int op;
	int direct; /* fd is O_DIRECT: resubmit from aligned point */
	int state;
	char *buf;
	struct iovec *iov;     /* NIO_MAX_IOV entries (owned by the context) */
	struct iovec *sub_iov; /* scratch: the part of iov still to transfer */
	int niov;
	uint64_t off;
	size_t len;  /* bytes requested */
	size_t need; /* bytes that must arrive (reads may stop at EOF) */
	size_t done;
	int err;	  /* positive errno once DONE with failure */
	uint64_t err_off; /* file offset of the failing transfer */
	int retries;
	/* portable backend bookkeeping */
	struct nio_req *next;
	long res;
	const struct iovec *sub_vec;
	int sub_cnt;
	uint64_t sub_off;
};

struct nio_ctx;

struct nio_backend {
	const char *name;
	/*
	 * Queue one transfer of iov[0..cnt) for req at off (cnt > 1 only for
	 * writes); returns 0 or a positive errno. iov stays valid until the
	 * transfer completes.
	 */
	int (*submit)(struct nio_ctx *ctx, struct nio_req *req, const struct iovec *iov, int cnt,
		      uint64_t off);
	/*
	 * Block for one completion, at most timeout_ms (0: no bound); returns 0,
	 * ETIMEDOUT or another positive errno (fatal).
	 */
	int (*wait)(struct nio_ctx *ctx, struct nio_req **req, long *res, unsigned timeout_ms);
	void (*destroy)(struct nio_ctx *ctx);
};

/*
 * An I/O context: staging arena (nslots blocks), the requests that use it
 * and a backend instance. Owned by one writer/reader at a time; cached on the
 * engine between files so the arena is allocated once.
 */
struct nio_ctx {
	int kind;
	size_t block_size;
	unsigned qd;	 /* transfers in flight (a writer: qd blocks' worth of bytes) */
	unsigned nslots; /* qd + 1: one slot is filled while qd fly */
	unsigned nreqs;	 /* requests: nslots, or more for a writer's uncopied transfers */
	char *arena;
	size_t arena_size;
	struct nio_req *reqs; /* nreqs; the reader uses the first nslots */
	struct iovec *iovs;   /* 2 * NIO_MAX_IOV per request: its iov and sub_iov */
	unsigned inflight;    /* transfers handed to the backend */
	int broken;	      /* backend failed: never reuse */
	/*
	 * stall_ms: the longest wait for a completion (0: no bound); set by the
	 * writer. A read is never abandoned: its transfers land in the caller's
	 * memory. stalled: a wait ran out, the transfers in flight are abandoned
	 * to the kernel (their memory is never freed), the context is broken.
	 */
	unsigned stall_ms;
	int stalled;
	unsigned phantoms; /* test build: transfers counted in flight but never submitted */
	pid_t pid;	   /* creator; threads and rings do not survive fork */
	const struct nio_backend *be;
	void *priv;
};

/* Error report of the pure C layer; module.c turns it into an exception. */
struct nio_error {
	int err;	/* positive errno, 0 = none */
	const char *op; /* "write", "read", "fdatasync", ... */
	uint64_t off;
	int has_off;
};

/* crc32c.c */
void nio_crc32c_init(void);
const char *nio_crc32c_impl(void);
uint32_t nio_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t nio_crc32c_copy(void *dst, const void *src, size_t len, uint32_t crc);

/* arena.c */
void *nio_aligned_alloc(size_t size);
void nio_aligned_free(void *p, size_t size);
int nio_ctx_create(int kind, size_t block_size, unsigned qd, struct nio_ctx **out, char *why,
		   size_t whylen);
void nio_ctx_destroy(struct nio_ctx *ctx);
static inline char *nio_slot(struct nio_ctx *ctx, unsigned i)
{
	return ctx->arena + (size_t)i * ctx->block_size;
}

/* iocore.c */
#ifdef NATIVE_IO_TESTING
/*
 * Test-only fault injection. Compiled into native_io._native_io_testing
 * only, so the release module has no way to corrupt I/O on purpose.
 */
struct nio_faults {
	long short_every;
	long eintr_every;
	long eio_at;
	long stall_at; /* the stall_at-th transfer is never submitted: its completion never comes */
	int refuse_direct;
	int refuse_uring;
	int refuse_fallocate;
};
extern struct nio_faults nio_faults;
void nio_faults_set(long short_every, long eintr_every, long eio_at, long stall_at,
		    int refuse_direct, int refuse_uring, int refuse_fallocate);
#define NIO_FAULT(field) (nio_faults.field)
#else
#define NIO_FAULT(field) 0
#endif
void nio_req_setup(struct nio_req *req, int fd, int op, int direct, char *buf, uint64_t off,
		   size_t len, size_t need);
void nio_req_setup_vec(struct nio_req *req, int fd, int direct, const struct iovec *iov, int niov,
		       uint64_t off, size_t len);
void nio_req_start(struct nio_ctx *ctx, struct nio_req *req);
int nio_reap_one(struct nio_ctx *ctx);
int nio_wait_req(struct nio_ctx *ctx, struct nio_req *req);
int nio_drain(struct nio_ctx *ctx);

/* uring_engine.c */
int nio_uring_compiled(void);
const char *nio_uring_version(void);
int nio_uring_init(struct nio_ctx *ctx, char *why, size_t whylen);
int nio_uring_probe(char *why, size_t whylen);

/* portable_engine.c */
int nio_portable_init(struct nio_ctx *ctx, char *why, size_t whylen);

/* writer.c */
struct nio_writer {
	struct nio_ctx *ctx;
	int fd;
	int direct;
	/*
	 * The transfer being gathered starts at file offset run_off (aligned):
	 * closed pieces (iov: staged runs of the arena and the caller's aligned
	 * bodies, gathered bytes in all), then the open piece, fill bytes staged
	 * at arena offset run (aligned). At most block_size bytes in all.
	 */
	uint64_t run_off;
	size_t gathered;
	struct iovec iov[NIO_MAX_IOV];
	int niov;
	int has_user;	/* a piece is the caller's memory */
	int arena_used; /* a piece is staged: the first starts at arena_lo */
	size_t arena_lo;
	size_t run;
	size_t fill;
	/* arena bytes [lo, hi) read by the transfer in reqs[i] (0, 0: none) */
	size_t req_lo[NIO_MAX_REQS], req_hi[NIO_MAX_REQS];
	uint64_t end;	   /* end of the last segment */
	uint64_t payload;  /* bytes handed in by segments */
	uint64_t io_bytes; /* bytes transferred to the file */
	uint64_t unstaged; /* payload bytes sent from the caller's memory */
	uint64_t reserved; /* bytes preallocated at open (0: none) */
	uint64_t submits;  /* transfers submitted so far; the n-th uses reqs[n % nreqs] */
	uint64_t retired;  /* the first `retired` submitted transfers are complete (in order) */
	uint64_t inflight_bytes; /* of the transfers submitted and not retired */
};
void nio_writer_init(struct nio_writer *w, struct nio_ctx *ctx, int fd, int direct,
		     unsigned stall_ms);
int nio_writer_put(struct nio_writer *w, uint64_t off, const void *src, size_t len, uint32_t *crc,
		   struct nio_error *e);
int nio_writer_put_unstaged(struct nio_writer *w, uint64_t off, const void *src, size_t len,
			    int have_crc, uint32_t *crc, struct nio_error *e);
int nio_writer_put_auto(struct nio_writer *w, uint64_t off, const void *src, size_t len,
			size_t min_body, uint32_t *crc, int *in_flight, struct nio_error *e);
int nio_writer_release_user(struct nio_writer *w, struct nio_error *e);
int nio_device_splits_pages(int fd);
int nio_writer_wait_all(struct nio_writer *w, struct nio_error *e);
int nio_writer_finish(struct nio_writer *w, int have_size, uint64_t size, struct nio_error *e);
void nio_writer_abort(struct nio_writer *w);
int nio_writer_preallocate(struct nio_writer *w, uint64_t size);
int nio_reserve(int fd, uint64_t off, uint64_t len);

/* reader.c */
struct nio_rseg {
	uint64_t off;
	char *buf;
	size_t len;
	uint32_t crc;
};
/*
 * Told, after each retired transfer, how many leading segments are read with
 * their crc final (segs[0..done)): a consumer may use them while the rest are
 * still read. A nonzero return cancels the read: nothing more is submitted,
 * the transfers in flight land, and the read fails with ECANCELED.
 */
typedef int (*nio_read_progress_fn)(void *arg, const struct nio_rseg *segs, size_t done);

int nio_read_segments(struct nio_ctx *ctx, int fd, int direct, size_t direct_min,
		      uint64_t file_size, struct nio_rseg *segs, size_t nsegs, uint64_t *io_bytes,
		      uint64_t *to_dest_bytes, nio_read_progress_fn progress, void *progress_arg,
		      struct nio_error *e);

#endif /* NATIVE_IO_NIO_H */
