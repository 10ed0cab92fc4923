// SPDX-License-Identifier: Apache-2.0
/*
 * Coalescing writer. Segments are copied (with their crc32c folded into the
 * copy) into a run in the staging arena: contiguous bytes of the file from a
 * 4096-aligned offset, at most block_size long. A full run is submitted as
 * one transfer and the next is staged while up to qd blocks' worth of bytes
 * are in flight. Large aligned bodies can instead go straight from the
 * caller's memory (unstaged), as transfers of any size; the run before such
 * a body is sent short, and the next run starts right after it in the
 * arena, which is used as a ring. Up to NIO_WRITE_REQS transfers fly, so
 * that small ones still keep the device busy; they retire in submission
 * order. Gaps are zero-filled inside a run and skipped (left as a hole,
 * which reads as zeros) between runs. Runs without the GIL: no Python API
 * here.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fallocate */
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include "nio.h"

/* stall_ms: the longest wait for one completion before the write fails (0: no bound). */
void nio_writer_init(struct nio_writer *w, struct nio_ctx *ctx, int fd, int direct,
		     unsigned stall_ms)
{
	memset(w, 0, sizeof(*w));
	w->ctx = ctx;
	ctx->stall_ms = stall_ms;
	w->fd = fd;
	w->direct = direct;
	for (unsigned i = 0; i < ctx->nreqs; i++)
		ctx->reqs[i].state = NIO_REQ_IDLE;
}

static void set_err(struct nio_error *e, int err, const char *op, int has_off, uint64_t off)
{
	e->err = err;
	e->op = op;
	e->has_off = has_off;
	e->off = off;
}

/*
 * Reserve [0, size) before the first write (size: the caller's estimate of
 * the final size), with FALLOC_FL_KEEP_SIZE: the blocks are allocated up
 * front but the file's size still grows only with what is written, so a torn
 * file is never longer than its data. Past size, writes extend the file as
 * usual; finish()'s ftruncate gives an unused reservation back.
 * Returns 0 when reserved, else the errno (EOPNOTSUPP where the filesystem
 * has no fallocate, ENOSPC, ...): the writer then goes on without one.
 */
int nio_writer_preallocate(struct nio_writer *w, uint64_t size)
{
	int rc;

	if (!size)
		return 0;
	if (NIO_FAULT(refuse_fallocate))
		return EOPNOTSUPP;
	do {
		rc = fallocate(w->fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)size);
	} while (rc && errno == EINTR);
	if (rc)
		return errno;
	w->reserved = size;
	return 0;
}

/*
 * fallocate(fd, 0, off, len): allocate [off, off + len) and grow the file's
 * size to cover it, for a writer that streams and so cannot say its size up
 * front (see lightning_recover/checkpoint/reservation.py): ext4 takes an
 * O_DIRECT write inside the file far better than one that extends it.
 * Returns 0 or the errno. Unlike glibc's posix_fallocate there is no
 * emulation by writing a byte per block, which could race the writer.
 */
int nio_reserve(int fd, uint64_t off, uint64_t len)
{
	int rc;

	if (NIO_FAULT(refuse_fallocate))
		return EOPNOTSUPP;
	do {
		rc = fallocate(fd, 0, (off_t)off, (off_t)len);
	} while (rc && errno == EINTR);
	return rc ? errno : 0;
}

static int read_sysfs_ulong(const char *path, unsigned long *v)
{
	FILE *f = fopen(path, "r");
	int ok;

	if (!f)
		return -1;
	ok = fscanf(f, "%lu", v) == 1;
	fclose(f);
	return ok ? 0 : -1;
}

/* max_segments and max_sectors_kb of the device under the file (a partition: its disk's). */
static int device_limits(int fd, unsigned long *segs, unsigned long *kb)
{
	static const char *const dirs[] = { "/sys/dev/block/%u:%u/queue/%s",
					    "/sys/dev/block/%u:%u/../queue/%s" };
	struct stat st;
	char path[128];

	if (fstat(fd, &st))
		return -1;
	for (unsigned i = 0; i < 2; i++) {
		snprintf(path, sizeof(path), dirs[i], major(st.st_dev), minor(st.st_dev),
			 "max_segments");
		if (read_sysfs_ulong(path, segs))
			continue;
		snprintf(path, sizeof(path), dirs[i], major(st.st_dev), minor(st.st_dev),
			 "max_sectors_kb");
		if (!read_sysfs_ulong(path, kb))
			return 0;
	}
	return -1;
}

/*
 * Does the file's device split an O_DIRECT transfer from 4 KiB pages into
 * requests smaller than it takes? Each page is a segment, a request holds
 * at most max_segments of them: virtio-blk (254 segments, 4 MiB requests)
 * takes a transfer from plain pages in ~1 MiB requests, one from the
 * arena's huge pages whole. Such a device writes staged (copied) bytes
 * faster than the caller's memory, unless that is on huge pages too.
 * 1: it does; 0: it does not, or no block device is found (tmpfs, overlay).
 */
int nio_device_splits_pages(int fd)
{
	unsigned long segs, kb;

	if (device_limits(fd, &segs, &kb))
		return 0;
	return segs * 4 < kb;
}

/* Wait for the oldest transfer not yet retired; report its failure if it had one. */
static int retire_oldest(struct nio_writer *w, struct nio_error *e)
{
	struct nio_req *req = &w->ctx->reqs[w->retired % w->ctx->nreqs];
	int rc;

	rc = nio_wait_req(w->ctx, req);
	if (rc == ETIMEDOUT) {
		set_err(e, rc,
			"write: no completion from the device within the engine's completion_timeout",
			1, req->off);
		return -1;
	}
	if (rc) {
		set_err(e, rc, "write (waiting for completion)", 0, 0);
		return -1;
	}
	w->retired++;
	w->inflight_bytes -= req->len;
	if (req->state == NIO_REQ_DONE) {
		req->state = NIO_REQ_IDLE;
		if (req->err) {
			set_err(e, req->err, "write", 1, req->err_off);
			return -1;
		}
		w->io_bytes += req->len;
	}
	return 0;
}

/* Retire transfers in order until the first n submitted are complete. */
static int retire_to(struct nio_writer *w, uint64_t n, struct nio_error *e)
{
	while (w->retired < n)
		if (retire_oldest(w, e))
			return -1;
	return 0;
}

/*
 * Submit the gathered pieces as one transfer at run_off. Waits first for a
 * free request and until at most qd blocks' worth of bytes, this transfer's
 * included, are in flight. The open piece (fill bytes at run) stays: it
 * starts the next transfer.
 */
static int submit_gathered(struct nio_writer *w, struct nio_error *e)
{
	struct nio_ctx *ctx = w->ctx;
	uint64_t budget = (uint64_t)ctx->qd * ctx->block_size;
	unsigned i = (unsigned)(w->submits % ctx->nreqs);
	size_t len = w->gathered;
	struct nio_req *req;

	if (!w->niov)
		return 0;
	if (w->submits - w->retired >= ctx->nreqs && retire_to(w, w->submits + 1 - ctx->nreqs, e))
		return -1;
	while (w->retired < w->submits && w->inflight_bytes + len > budget)
		if (retire_oldest(w, e))
			return -1;
	req = &ctx->reqs[i];
	w->req_lo[i] = w->arena_used ? w->arena_lo : 0;
	w->req_hi[i] = w->arena_used ? w->run : 0;
	if (w->niov == 1)
		nio_req_setup(req, w->fd, NIO_OP_WRITE, w->direct, w->iov[0].iov_base, w->run_off,
			      len, len);
	else
		nio_req_setup_vec(req, w->fd, w->direct, w->iov, w->niov, w->run_off, len);
	nio_req_start(ctx, req);
	w->submits++;
	w->inflight_bytes += len;
	w->run_off += len;
	w->gathered = 0;
	w->niov = 0;
	w->arena_used = 0;
	w->has_user = 0;
	if (req->state == NIO_REQ_DONE && req->err) {
		set_err(e, req->err, "write (submit)", 1, req->err_off);
		return -1;
	}
	return 0;
}

/* Append [base, base+len) to the gathered pieces (the caller left room for it). */
static void add_piece(struct nio_writer *w, char *base, size_t len)
{
	struct iovec *last = w->niov ? &w->iov[w->niov - 1] : NULL;

	if (last && (char *)last->iov_base + last->iov_len == base) {
		last->iov_len += len; /* contiguous in memory too: one piece */
	} else {
		w->iov[w->niov].iov_base = base;
		w->iov[w->niov++].iov_len = len;
	}
	w->gathered += len;
}

/* Arena bytes [lo, hi), once no transfer in flight reads them. */
static char *arena_free(struct nio_writer *w, size_t lo, size_t hi, struct nio_error *e)
{
	for (uint64_t n = w->retired; n < w->submits; n++) {
		unsigned i = (unsigned)(n % w->ctx->nreqs);

		if (w->req_lo[i] < hi && lo < w->req_hi[i] && retire_to(w, n + 1, e))
			return NULL;
	}
	return w->ctx->arena + lo;
}

/*
 * Close the open piece (padded to NIO_ALIGN when O_DIRECT) into the
 * gathered ones; the next open piece starts after it in the arena.
 */
static int close_piece(struct nio_writer *w, struct nio_error *e)
{
	size_t n = w->direct ? (size_t)NIO_ALIGN_UP((uint64_t)w->fill) : w->fill;
	char *pad;

	if (!w->fill)
		return 0;
	if (!(pad = arena_free(w, w->run + w->fill, w->run + n, e)))
		return -1;
	memset(pad, 0, n - w->fill);
	if (!w->arena_used) {
		w->arena_used = 1;
		w->arena_lo = w->run;
	}
	add_piece(w, w->ctx->arena + w->run, n);
	w->run = (size_t)NIO_ALIGN_UP((uint64_t)(w->run + n));
	w->fill = 0;
	return 0;
}

/* Send everything gathered, the open piece included (padded). */
static int submit_all(struct nio_writer *w, struct nio_error *e)
{
	return close_piece(w, e) || submit_gathered(w, e) ? -1 : 0;
}

/*
 * Room to stage n more bytes in the open piece; returns where they go. A
 * piece never wraps around the arena and a transfer's staged pieces lie in
 * one stretch of it, so a new piece that would pass the arena's end sends
 * the transfer and starts over at the arena's start.
 */
static char *stage(struct nio_writer *w, size_t n, struct nio_error *e)
{
	struct nio_ctx *ctx = w->ctx;

	if (!w->fill && (w->niov >= NIO_MAX_IOV - 1 ||
			 w->run + (ctx->block_size - w->gathered) > ctx->arena_size)) {
		if (submit_gathered(w, e))
			return NULL;
		if (w->run + ctx->block_size > ctx->arena_size)
			w->run = 0;
	}
	return arena_free(w, w->run + w->fill, w->run + w->fill + n, e);
}

int nio_writer_put(struct nio_writer *w, uint64_t off, const void *src, size_t len, uint32_t *crc,
		   struct nio_error *e)
{
	size_t bs = w->ctx->block_size;
	uint64_t pos = w->run_off + w->gathered + w->fill;
	const char *s = src;
	size_t left = len;
	uint32_t c = 0;
	char *dst;

	if (off < pos) {
		set_err(e, EINVAL, "write (overlapping segment)", 1, off);
		return -1;
	}
	if (off > pos && off - w->run_off >= bs) {
		/* the gap leaves this transfer: send it, start the next at off */
		if (submit_all(w, e))
			return -1;
		w->run_off = NIO_ALIGN_DOWN(off);
	}
	while ((pos = w->run_off + w->gathered + w->fill) < off) {
		size_t n = (size_t)(off - pos); /* a gap inside the transfer: zeros */

		if (!(dst = stage(w, n, e)))
			return -1;
		memset(dst, 0, n);
		w->fill += n;
	}
	while (left) {
		size_t n = bs - w->gathered - w->fill;

		if (n > left)
			n = left;
		if (!(dst = stage(w, n, e)))
			return -1;
		c = nio_crc32c_copy(dst, s, n, c);
		w->fill += n;
		s += n;
		left -= n;
		if (w->gathered + w->fill == bs && submit_all(w, e))
			return -1;
	}
	*crc = c;
	w->end = off + len;
	w->payload += len;
	return 0;
}

/*
 * Gather [src, src+body) at file offset off straight from the caller's
 * memory (O_DIRECT; src, off and body NIO_ALIGN-aligned, the caller checks):
 * the bytes staged before it and the bytes after it join it in transfers
 * of up to block_size. Does not wait: src is read until the transfers that
 * hold it have retired (nio_writer_release_user, then nio_writer_wait_all).
 */
static int gather_unstaged(struct nio_writer *w, uint64_t off, const char *src, size_t body,
			   struct nio_error *e)
{
	size_t bs = w->ctx->block_size;

	if (off < w->run_off + w->gathered + w->fill) {
		set_err(e, EINVAL, "write (overlapping segment)", 1, off);
		return -1;
	}
	if (w->run_off + w->gathered + NIO_ALIGN_UP((uint64_t)w->fill) == off) {
		/* right after the staged bytes (their padding ends at off): one transfer */
		if (close_piece(w, e))
			return -1;
	} else {
		if (submit_all(w, e))
			return -1;
		w->run_off = off;
	}
	for (size_t done = 0; done < body;) {
		size_t n = bs - w->gathered;

		if (!n || w->niov >= NIO_MAX_IOV - 1) {
			if (submit_gathered(w, e))
				return -1;
			n = bs;
		}
		if (n > body - done)
			n = body - done;
		add_piece(w, (char *)src + done, n);
		w->has_user = 1;
		done += n;
		if (w->gathered == bs && submit_gathered(w, e))
			return -1;
	}
	w->end = off + body;
	w->payload += body;
	w->unstaged += body;
	return 0;
}

/*
 * Submit the gathered transfer if it holds the caller's memory, so that
 * every transfer that reads the caller's memory is in flight: they are done
 * once `retired` reaches `submits`.
 */
int nio_writer_release_user(struct nio_writer *w, struct nio_error *e)
{
	return w->has_user ? submit_gathered(w, e) : 0;
}

int nio_writer_wait_all(struct nio_writer *w, struct nio_error *e)
{
	if (nio_writer_release_user(w, e))
		return -1;
	return retire_to(w, w->submits, e);
}

/*
 * Write [src, src+len) at off without copying its aligned body into the
 * arena: the body goes to the device straight from src (gathered with the
 * bytes staged before it), and only the unaligned tail (< NIO_ALIGN) is
 * staged. Requires an O_DIRECT writer, src and off NIO_ALIGN-aligned (the
 * caller checks). Returns once no transfer reads src any more, so the caller
 * may reuse it. *crc is computed here (while the body is in flight)
 * unless have_crc says the caller knows it.
 */
int nio_writer_put_unstaged(struct nio_writer *w, uint64_t off, const void *src, size_t len,
			    int have_crc, uint32_t *crc, struct nio_error *e)
{
	size_t body = (size_t)NIO_ALIGN_DOWN((uint64_t)len);
	const char *s = src;
	uint32_t tail_crc;

	/* the body goes out before its CRC is computed, so that the two overlap */
	if (gather_unstaged(w, off, s, body, e) || nio_writer_release_user(w, e))
		return -1;
	if (!have_crc)
		*crc = nio_crc32c(0, src, len);
	if (nio_writer_wait_all(w, e))
		return -1;
	if (len > body)
		return nio_writer_put(w, off + body, s + body, len - body, &tail_crc, e);
	return 0;
}

/*
 * nio_writer_put, except that on an O_DIRECT writer a segment whose memory
 * and file offset are congruent modulo NIO_ALIGN, with an aligned interior of
 * at least min_body bytes (min_body > 0), has that interior sent from src
 * without a copy, gathered with its staged head and tail (< NIO_ALIGN each)
 * and its neighbours. Sets *in_flight when it did: src is read until the
 * transfers holding it retire (nio_writer_wait_all).
 */
int nio_writer_put_auto(struct nio_writer *w, uint64_t off, const void *src, size_t len,
			size_t min_body, uint32_t *crc, int *in_flight, struct nio_error *e)
{
	const char *s = src;
	uint64_t a = NIO_ALIGN_UP(off), b = NIO_ALIGN_DOWN(off + len);
	uint32_t part_crc;
	size_t head;

	if (!w->direct || !min_body || (uintptr_t)s % NIO_ALIGN != off % NIO_ALIGN || b <= a ||
	    b - a < min_body)
		return nio_writer_put(w, off, src, len, crc, e);
	head = (size_t)(a - off);
	if (head && nio_writer_put(w, off, s, head, &part_crc, e))
		return -1;
	if (gather_unstaged(w, a, s + head, (size_t)(b - a), e))
		return -1;
	*in_flight = 1;
	*crc = nio_crc32c(0, s, len); /* while earlier transfers are in flight */
	if (off + len > b)
		return nio_writer_put(w, b, s + (b - off), (size_t)(off + len - b), &part_crc, e);
	return 0;
}

int nio_writer_finish(struct nio_writer *w, int have_size, uint64_t size, struct nio_error *e)
{
	uint64_t target = have_size ? size : w->end;
	int rc;

	if (submit_all(w, e) || nio_writer_wait_all(w, e))
		return -1;
	/* drop the O_DIRECT padding (or extend with a hole to size) */
	do {
		rc = ftruncate(w->fd, (off_t)target);
	} while (rc && errno == EINTR);
	if (rc) {
		set_err(e, errno, "ftruncate", 1, target);
		return -1;
	}
	do {
		rc = fdatasync(w->fd);
	} while (rc && errno == EINTR);
	if (rc) {
		set_err(e, errno, "fdatasync", 0, 0);
		return -1;
	}
	return 0;
}

/* Forget staged data and wait out in-flight transfers (error paths). */
void nio_writer_abort(struct nio_writer *w)
{
	struct nio_ctx *ctx = w->ctx;

	if (nio_drain(ctx))
		ctx->broken = 1;
	for (unsigned i = 0; i < ctx->nreqs; i++)
		ctx->reqs[i].state = NIO_REQ_IDLE;
	w->fill = 0;
	w->gathered = 0;
	w->niov = 0;
	w->arena_used = 0;
	w->has_user = 0;
	/* even if the drain failed: its buffers are the caller's to release (abort discards the file) */
	w->retired = w->submits;
	w->inflight_bytes = 0;
}
