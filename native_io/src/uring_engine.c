// SPDX-License-Identifier: Apache-2.0
/*
 * io_uring backend (liburing). One ring per I/O context, sized for the
 * queue depth; each transfer is one read/write SQE whose user_data is the
 * request. Submission happens right away so the device sees the transfer
 * while the caller stages the next block.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nio.h"

#ifdef NATIVE_IO_HAVE_URING
#include <liburing.h>

struct uring_priv {
	struct io_uring ring;
};

int nio_uring_compiled(void)
{
	return 1;
}

const char *nio_uring_version(void)
{
#if defined(IO_URING_VERSION_MAJOR) && defined(IO_URING_VERSION_MINOR)
#define NIO_STR2(x) #x
#define NIO_STR(x)  NIO_STR2(x)
	return NIO_STR(IO_URING_VERSION_MAJOR) "." NIO_STR(IO_URING_VERSION_MINOR);
#else
	return NULL; /* liburing < 2.4 has no version macros */
#endif
}

static void describe_refusal(int err, char *why, size_t whylen)
{
	FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
	int disabled = -1;

	if (f) {
		if (fscanf(f, "%d", &disabled) != 1)
			disabled = -1;
		fclose(f);
	}
	if (disabled > 0)
		snprintf(why, whylen,
			 "io_uring_queue_init failed: %s (kernel.io_uring_disabled=%d)",
			 strerror(err), disabled);
	else
		snprintf(why, whylen, "io_uring_queue_init failed: %s", strerror(err));
}

static int uring_submit(struct nio_ctx *ctx, struct nio_req *req, const struct iovec *iov, int cnt,
			uint64_t off)
{
	struct uring_priv *p = ctx->priv;
	struct io_uring_sqe *sqe;
	int ret, tries = 0;

	sqe = io_uring_get_sqe(&p->ring);
	if (!sqe) {
		ret = io_uring_submit(&p->ring);
		if (ret < 0)
			return -ret;
		sqe = io_uring_get_sqe(&p->ring);
		if (!sqe)
			return EBUSY;
	}
	if (cnt > 1)
		io_uring_prep_writev(sqe, req->fd, iov, (unsigned)cnt, off);
	else if (req->op == NIO_OP_WRITE)
		io_uring_prep_write(sqe, req->fd, iov->iov_base, (unsigned)iov->iov_len, off);
	else
		io_uring_prep_read(sqe, req->fd, iov->iov_base, (unsigned)iov->iov_len, off);
	io_uring_sqe_set_data(sqe, req);
	for (;;) {
		ret = io_uring_submit(&p->ring);
		if (ret >= 1)
			return 0;
		if ((ret == -EINTR || ret == -EAGAIN) && ++tries < NIO_MAX_RETRIES)
			continue;
		/*
		 * The SQE stays queued in the SQ ring and would be submitted
		 * later with a dangling buffer: the context must be discarded.
		 */
		ctx->broken = 1;
		return ret < 0 ? -ret : EIO;
	}
}

static int uring_wait(struct nio_ctx *ctx, struct nio_req **req, long *res, unsigned timeout_ms)
{
	struct uring_priv *p = ctx->priv;
	uint64_t deadline = timeout_ms ? nio_now_ns() + (uint64_t)timeout_ms * 1000000ull : 0;
	struct io_uring_cqe *cqe;
	int ret;

	for (;;) {
		if (deadline) {
			uint64_t t = nio_now_ns(), left = deadline > t ? deadline - t : 0;
			struct __kernel_timespec ts = { .tv_sec = (long long)(left / 1000000000ull),
							.tv_nsec =
								(long long)(left % 1000000000ull) };

			ret = io_uring_wait_cqe_timeout(&p->ring, &cqe, &ts);
			if (ret == -ETIME)
				return ETIMEDOUT;
		} else {
			ret = io_uring_wait_cqe(&p->ring, &cqe);
		}
		if (ret == 0)
			break;
		if (ret != -EINTR && ret != -EAGAIN)
			return -ret;
	}
	*req = io_uring_cqe_get_data(cqe);
	*res = cqe->res;
	io_uring_cqe_seen(&p->ring, cqe);
	return 0;
}

static void uring_destroy(struct nio_ctx *ctx)
{
	struct uring_priv *p = ctx->priv;

	if (!p)
		return;
	/* tearing down the ring waits for/cancels outstanding requests */
	io_uring_queue_exit(&p->ring);
	free(p);
	ctx->priv = NULL;
}

static const struct nio_backend uring_backend = {
	.name = "uring",
	.submit = uring_submit,
	.wait = uring_wait,
	.destroy = uring_destroy,
};

int nio_uring_init(struct nio_ctx *ctx, char *why, size_t whylen)
{
	struct uring_priv *p;
	unsigned entries = 8;
	int ret;

	if (NIO_FAULT(refuse_uring)) {
		snprintf(why, whylen,
			 "io_uring_queue_init failed: %s (simulated by _inject_faults)",
			 strerror(EPERM));
		return EPERM;
	}
	while (entries < ctx->nreqs * 2)
		entries <<= 1;
	p = calloc(1, sizeof(*p));
	if (!p) {
		snprintf(why, whylen, "out of memory");
		return ENOMEM;
	}
	ret = io_uring_queue_init(entries, &p->ring, 0);
	if (ret < 0) {
		describe_refusal(-ret, why, whylen);
		free(p);
		return -ret;
	}
	ctx->priv = p;
	ctx->be = &uring_backend;
	return 0;
}

/* Can this process really use io_uring? Init a ring and run one NOP. */
int nio_uring_probe(char *why, size_t whylen)
{
	struct io_uring ring;
	struct io_uring_sqe *sqe;
	struct io_uring_cqe *cqe;
	int ret;

	if (NIO_FAULT(refuse_uring)) {
		snprintf(why, whylen,
			 "io_uring_queue_init failed: %s (simulated by _inject_faults)",
			 strerror(EPERM));
		return EPERM;
	}
	ret = io_uring_queue_init(4, &ring, 0);
	if (ret < 0) {
		describe_refusal(-ret, why, whylen);
		return -ret;
	}
	sqe = io_uring_get_sqe(&ring);
	if (!sqe) {
		ret = -EBUSY;
		goto out;
	}
	io_uring_prep_nop(sqe);
	ret = io_uring_submit(&ring);
	if (ret < 0)
		goto out;
	do {
		ret = io_uring_wait_cqe(&ring, &cqe);
	} while (ret == -EINTR);
	if (ret == 0) {
		ret = cqe->res;
		io_uring_cqe_seen(&ring, cqe);
	}
out:
	io_uring_queue_exit(&ring);
	if (ret < 0) {
		snprintf(why, whylen, "io_uring NOP failed: %s", strerror(-ret));
		return -ret;
	}
	return 0;
}

#else /* !NATIVE_IO_HAVE_URING */

int nio_uring_compiled(void)
{
	return 0;
}

const char *nio_uring_version(void)
{
	return NULL;
}

int nio_uring_init(struct nio_ctx *ctx, char *why, size_t whylen)
{
	snprintf(why, whylen, "native_io was built without liburing");
	return ENOSYS;
}

int nio_uring_probe(char *why, size_t whylen)
{
	snprintf(why, whylen, "native_io was built without liburing");
	return ENOSYS;
}

#endif
