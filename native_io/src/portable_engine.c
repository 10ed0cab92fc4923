// SPDX-License-Identifier: Apache-2.0
/*
 * Portable backend: pread/pwrite from a small pool of worker threads, one
 * per queue-depth slot (capped). Used without liburing, when the kernel
 * refuses io_uring, and for files that cannot be opened O_DIRECT. Buffered
 * (non O_DIRECT) writes are issued in pieces of at most NIO_BUFFERED_MAX so
 * page-cache writeback can start while the block is still being written.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "nio.h"

#define PORTABLE_MAX_THREADS 8

struct portable_priv {
	pthread_mutex_t lock;
	pthread_cond_t work_cv;
	pthread_cond_t done_cv;
	struct nio_req *pend_head, *pend_tail;
	struct nio_req *done_head, *done_tail;
	int stop;
	unsigned nthreads;
	pthread_t threads[PORTABLE_MAX_THREADS];
};

static void push(struct nio_req **head, struct nio_req **tail, struct nio_req *req)
{
	req->next = NULL;
	if (*tail)
		(*tail)->next = req;
	else
		*head = req;
	*tail = req;
}

static struct nio_req *pop(struct nio_req **head, struct nio_req **tail)
{
	struct nio_req *req = *head;

	if (req) {
		*head = req->next;
		if (!*head)
			*tail = NULL;
		req->next = NULL;
	}
	return req;
}

/* One transfer; returns bytes moved (possibly short) or -errno. */
static long do_io(struct nio_req *req)
{
	char *buf = req->sub_vec[0].iov_base;
	uint64_t off = req->sub_off;
	size_t len = req->sub_vec[0].iov_len, total = 0;

	if (req->sub_cnt > 1) {
		/* a gathered write (O_DIRECT): one call, a short result goes back to the core */
		ssize_t r = pwritev(req->fd, req->sub_vec, req->sub_cnt, (off_t)off);

		return r < 0 ? -(long)errno : (long)r;
	}

	while (total < len) {
		size_t n = len - total;
		ssize_t r;

		if (!req->direct && req->op == NIO_OP_WRITE && n > NIO_BUFFERED_MAX)
			n = NIO_BUFFERED_MAX;
		if (req->op == NIO_OP_WRITE)
			r = pwrite(req->fd, buf + total, n, (off_t)(off + total));
		else
			r = pread(req->fd, buf + total, n, (off_t)(off + total));
		if (r < 0)
			return total ? (long)total : -(long)errno;
		if (r == 0)
			break;
		total += (size_t)r;
		if ((size_t)r < n)
			break; /* short: the core decides what to resubmit */
	}
	return (long)total;
}

static void *worker(void *arg)
{
	struct portable_priv *p = arg;
	struct nio_req *req;
	long res;

	pthread_mutex_lock(&p->lock);
	for (;;) {
		while (!p->stop && !p->pend_head)
			pthread_cond_wait(&p->work_cv, &p->lock);
		req = pop(&p->pend_head, &p->pend_tail);
		if (!req)
			break; /* stop requested and nothing pending */
		pthread_mutex_unlock(&p->lock);
		res = do_io(req);
		pthread_mutex_lock(&p->lock);
		req->res = res;
		push(&p->done_head, &p->done_tail, req);
		pthread_cond_signal(&p->done_cv);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

static int portable_submit(struct nio_ctx *ctx, struct nio_req *req, const struct iovec *iov,
			   int cnt, uint64_t off)
{
	struct portable_priv *p = ctx->priv;

	pthread_mutex_lock(&p->lock);
	req->sub_vec = iov;
	req->sub_cnt = cnt;
	req->sub_off = off;
	push(&p->pend_head, &p->pend_tail, req);
	pthread_cond_signal(&p->work_cv);
	pthread_mutex_unlock(&p->lock);
	return 0;
}

static int portable_wait(struct nio_ctx *ctx, struct nio_req **req, long *res, unsigned timeout_ms)
{
	struct portable_priv *p = ctx->priv;
	uint64_t deadline = nio_now_ns() + (uint64_t)timeout_ms * 1000000ull;
	struct timespec ts = { .tv_sec = (time_t)(deadline / 1000000000ull),
			       .tv_nsec = (long)(deadline % 1000000000ull) };
	struct nio_req *r;

	pthread_mutex_lock(&p->lock);
	while (!p->done_head) {
		if (!timeout_ms) {
			pthread_cond_wait(&p->done_cv, &p->lock);
		} else if (pthread_cond_timedwait(&p->done_cv, &p->lock, &ts) == ETIMEDOUT &&
			   !p->done_head) {
			pthread_mutex_unlock(&p->lock);
			return ETIMEDOUT;
		}
	}
	r = pop(&p->done_head, &p->done_tail);
	pthread_mutex_unlock(&p->lock);
	*req = r;
	*res = r->res;
	return 0;
}

static void stop_threads(struct portable_priv *p, unsigned n)
{
	pthread_mutex_lock(&p->lock);
	p->stop = 1;
	pthread_cond_broadcast(&p->work_cv);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < n; i++)
		pthread_join(p->threads[i], NULL);
}

static void free_priv(struct portable_priv *p)
{
	pthread_cond_destroy(&p->done_cv);
	pthread_cond_destroy(&p->work_cv);
	pthread_mutex_destroy(&p->lock);
	free(p);
}

static void portable_destroy(struct nio_ctx *ctx)
{
	struct portable_priv *p = ctx->priv;

	if (!p)
		return;
	ctx->priv = NULL;
	if (ctx->stalled && ctx->inflight > ctx->phantoms) {
		/* a worker may never come back from its call: let them go, keep their state */
		pthread_mutex_lock(&p->lock);
		p->stop = 1;
		pthread_cond_broadcast(&p->work_cv);
		pthread_mutex_unlock(&p->lock);
		for (unsigned i = 0; i < p->nthreads; i++)
			pthread_detach(p->threads[i]);
		return;
	}
	/* workers finish what is pending before they exit */
	stop_threads(p, p->nthreads);
	free_priv(p);
}

static const struct nio_backend portable_backend = {
	.name = "portable",
	.submit = portable_submit,
	.wait = portable_wait,
	.destroy = portable_destroy,
};

int nio_portable_init(struct nio_ctx *ctx, char *why, size_t whylen)
{
	struct portable_priv *p;
	pthread_condattr_t attr;
	sigset_t all, old;
	unsigned n = ctx->qd < PORTABLE_MAX_THREADS ? ctx->qd : PORTABLE_MAX_THREADS;
	int err = 0;

	p = calloc(1, sizeof(*p));
	if (!p) {
		snprintf(why, whylen, "out of memory");
		return ENOMEM;
	}
	if ((err = pthread_mutex_init(&p->lock, NULL))) {
		free(p);
		goto out_err;
	}
	if ((err = pthread_cond_init(&p->work_cv, NULL))) {
		pthread_mutex_destroy(&p->lock);
		free(p);
		goto out_err;
	}
	if ((err = pthread_condattr_init(&attr))) {
		pthread_cond_destroy(&p->work_cv);
		pthread_mutex_destroy(&p->lock);
		free(p);
		goto out_err;
	}
	/* completion waits are bounded in CLOCK_MONOTONIC time (nio_now_ns) */
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	err = pthread_cond_init(&p->done_cv, &attr);
	pthread_condattr_destroy(&attr);
	if (err) {
		pthread_cond_destroy(&p->work_cv);
		pthread_mutex_destroy(&p->lock);
		free(p);
		goto out_err;
	}
	/* workers never take signals: Python handles them on its own thread */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (p->nthreads = 0; p->nthreads < n; p->nthreads++) {
		err = pthread_create(&p->threads[p->nthreads], NULL, worker, p);
		if (err)
			break;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (err) {
		stop_threads(p, p->nthreads);
		free_priv(p);
		goto out_err;
	}
	ctx->priv = p;
	ctx->be = &portable_backend;
	return 0;
out_err:
	snprintf(why, whylen, "cannot start I/O threads: %s", strerror(err));
	return err;
}
