// SPDX-License-Identifier: Apache-2.0
/*
 * Request state machine shared by both backends.
 *
 * A backend performs one transfer and reports the raw result (bytes or
 * -errno). Here the result is judged: short transfers are resubmitted for the
 * remainder (from the last 4096 boundary when the fd is O_DIRECT), EINTR and
 * EAGAIN are resubmitted, anything else fails the request with its errno and
 * file offset. Test-only fault injection rewrites raw results at this single
 * point so both backends exercise the same requeue and error paths.
 */
#include <errno.h>
#include <string.h>
#include <time.h>
#include "nio.h"

uint64_t nio_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#ifdef NATIVE_IO_TESTING
struct nio_faults nio_faults;
static long io_counter, submit_counter;

void nio_faults_set(long short_every, long eintr_every, long eio_at, long stall_at,
		    int refuse_direct, int refuse_uring, int refuse_fallocate)
{
	nio_faults.short_every = short_every > 0 ? short_every : 0;
	nio_faults.eintr_every = eintr_every > 0 ? eintr_every : 0;
	nio_faults.eio_at = eio_at > 0 ? eio_at : 0;
	nio_faults.stall_at = stall_at > 0 ? stall_at : 0;
	nio_faults.refuse_direct = refuse_direct;
	nio_faults.refuse_uring = refuse_uring;
	nio_faults.refuse_fallocate = refuse_fallocate;
	__atomic_store_n(&io_counter, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&submit_counter, 0, __ATOMIC_SEQ_CST);
}

/* Is this the transfer whose completion never comes? */
static int stall_injected(void)
{
	return nio_faults.stall_at &&
	       __atomic_add_fetch(&submit_counter, 1, __ATOMIC_SEQ_CST) == nio_faults.stall_at;
}

static long inject(const struct nio_req *req, long res)
{
	long n, s;

	if (!nio_faults.short_every && !nio_faults.eintr_every && !nio_faults.eio_at)
		return res;
	n = __atomic_add_fetch(&io_counter, 1, __ATOMIC_SEQ_CST);
	if (nio_faults.eio_at && n == nio_faults.eio_at)
		return -EIO;
	if (res <= 0)
		return res;
	if (nio_faults.eintr_every && n % nio_faults.eintr_every == 0)
		return ((n / nio_faults.eintr_every) & 1) ? -EINTR : -EAGAIN;
	if (nio_faults.short_every && n % nio_faults.short_every == 0) {
		s = res / 2;
		if (req->direct)
			s = (long)NIO_ALIGN_DOWN((uint64_t)s);
		if (s > 0)
			return s;
	}
	return res;
}
#else
static inline long inject(const struct nio_req *req, long res)
{
	return res;
}

static inline int stall_injected(void)
{
	return 0;
}
#endif /* NATIVE_IO_TESTING */

void nio_req_setup(struct nio_req *req, int fd, int op, int direct, char *buf, uint64_t off,
		   size_t len, size_t need)
{
	req->fd = fd;
	req->op = op;
	req->direct = direct;
	req->buf = buf;
	req->niov = 0;
	req->off = off;
	req->len = len;
	req->need = need;
	req->done = 0;
	req->err = 0;
	req->err_off = 0;
	req->retries = 0;
	req->state = NIO_REQ_IDLE;
}

/* A gathered write of the len bytes of iov[0..niov) (copied into the request's own array). */
void nio_req_setup_vec(struct nio_req *req, int fd, int direct, const struct iovec *iov, int niov,
		       uint64_t off, size_t len)
{
	nio_req_setup(req, fd, NIO_OP_WRITE, direct, NULL, off, len, len);
	memcpy(req->iov, iov, (size_t)niov * sizeof(*iov));
	req->niov = niov;
}

static size_t resume_point(const struct nio_req *req)
{
	return req->direct ? (size_t)NIO_ALIGN_DOWN((uint64_t)req->done) : req->done;
}

static void fail(struct nio_req *req, int err, uint64_t off)
{
	req->err = err;
	req->err_off = off;
	req->state = NIO_REQ_DONE;
}

/* The pieces of a gathered request from byte `from` on, in its sub_iov; returns their count. */
static int vec_from(struct nio_req *req, size_t from)
{
	int i = 0, n = 0;

	while (i < req->niov && from >= req->iov[i].iov_len) {
		from -= req->iov[i].iov_len;
		i++;
	}
	for (; i < req->niov; i++) {
		req->sub_iov[n].iov_base = (char *)req->iov[i].iov_base + from;
		req->sub_iov[n++].iov_len = req->iov[i].iov_len - from;
		from = 0;
	}
	return n;
}

static void submit_rest(struct nio_ctx *ctx, struct nio_req *req)
{
	size_t from = resume_point(req);
	int n = 1, rc;

	if (req->niov) {
		n = vec_from(req, from);
	} else {
		req->sub_iov[0].iov_base = req->buf + from;
		req->sub_iov[0].iov_len = req->len - from;
	}
	if (stall_injected()) {
		ctx->inflight++;
		ctx->phantoms++;
		return;
	}
	/* sub_iov outlives the transfer: the portable backend's thread reads it */
	rc = ctx->be->submit(ctx, req, req->sub_iov, n, req->off + from);
	if (rc) {
		fail(req, rc, req->off + from);
		return;
	}
	ctx->inflight++;
}

void nio_req_start(struct nio_ctx *ctx, struct nio_req *req)
{
	req->done = 0;
	req->err = 0;
	req->retries = 0;
	req->state = NIO_REQ_BUSY;
	if (req->need == 0) {
		req->state = NIO_REQ_DONE;
		return;
	}
	submit_rest(ctx, req);
}

static void complete(struct nio_ctx *ctx, struct nio_req *req, long res)
{
	size_t from = resume_point(req);
	size_t asked = req->len - from;

	res = inject(req, res);
	if (res < 0) {
		int e = (int)-res;

		if ((e == EINTR || e == EAGAIN) && ++req->retries < NIO_MAX_RETRIES) {
			submit_rest(ctx, req);
			return;
		}
		fail(req, e, req->off + from);
		return;
	}
	if ((size_t)res > asked)
		res = (long)asked;
	if (from + (size_t)res > req->done) {
		req->done = from + (size_t)res;
		req->retries = 0;
	} else if (res == 0 && req->op == NIO_OP_READ) {
		/* end of file before the bytes we need: file shrank */
		fail(req, ENODATA, req->off + from);
		return;
	} else if (++req->retries >= NIO_MAX_RETRIES) {
		fail(req, EIO, req->off + from);
		return;
	}
	if (req->done >= req->need) {
		req->state = NIO_REQ_DONE;
		return;
	}
	submit_rest(ctx, req);
}

int nio_reap_one(struct nio_ctx *ctx)
{
	struct nio_req *req = NULL;
	long res = 0;
	int rc;

	if (ctx->stalled)
		return ETIMEDOUT; /* what is in flight was abandoned: nothing more will be reaped */
	rc = ctx->be->wait(ctx, &req, &res, ctx->stall_ms);
	if (rc) {
		ctx->broken = 1;
		ctx->stalled = rc == ETIMEDOUT;
		return rc;
	}
	ctx->inflight--;
	complete(ctx, req, res);
	return 0;
}

int nio_wait_req(struct nio_ctx *ctx, struct nio_req *req)
{
	int rc;

	while (req->state == NIO_REQ_BUSY) {
		if (!ctx->inflight) {
			/* cannot happen: busy request with nothing queued */
			ctx->broken = 1;
			fail(req, EIO, req->off);
			return 0;
		}
		rc = nio_reap_one(ctx);
		if (rc)
			return rc;
	}
	return 0;
}

int nio_drain(struct nio_ctx *ctx)
{
	int rc;

	while (ctx->inflight) {
		rc = nio_reap_one(ctx);
		if (rc)
			return rc;
	}
	return 0;
}
