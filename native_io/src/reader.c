// SPDX-License-Identifier: Apache-2.0
/*
 * Extent reader. Segments are turned into a stream of transfers:
 *  - "to dest": a large piece read straight into the caller's buffer, used
 *    when the fd is O_DIRECT and buffer address and file offset are 4096
 *    aligned, or when the fd is buffered (no alignment rules apply); a piece
 *    whose address and offset only agree modulo 4096 has its unaligned head
 *    read via the arena and the rest straight in;
 *  - "via arena": one aligned read of up to block_size into an arena slot
 *    that serves every consecutive small/unaligned piece inside it; the
 *    pieces are copied out (crc32c folded into the copy) when it retires.
 * Up to qd transfers fly; they retire in submission order so that per
 * segment checksums are chained in file order, and a progress callback can
 * hand the leading finished segments to a consumer while the rest are read.
 * Runs without the GIL.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "nio.h"

struct rop {
	int to_dest;
	size_t seg_b, pos_b, seg_e, pos_e; /* cursor range [b, e) */
	uint64_t foff;			   /* file offset of transfer */
	char *dest;			   /* to_dest only */
	size_t len, need;
};

struct planner {
	struct nio_rseg *segs;
	size_t nsegs, s, p;
	int direct;
	size_t bs;
	size_t direct_min; /* pieces this large or larger may go straight into dest */
	uint64_t file_size;
};

static int to_dest_ok(const struct planner *P, uint64_t fo, const char *dest, size_t rem)
{
	if (rem < P->direct_min)
		return 0;
	if (!P->direct)
		return 1;
	return !(fo & (NIO_ALIGN - 1)) && !((uintptr_t)dest & (NIO_ALIGN - 1));
}

/*
 * Bytes of the piece at file offset fo (destination dest, rem bytes) to read
 * via the arena before the rest can go straight into dest: its unaligned
 * head, when file offset and destination agree modulo NIO_ALIGN and enough
 * is left after it (0: no such split; the whole piece goes via the arena).
 */
static size_t congruent_head(const struct planner *P, uint64_t fo, const char *dest, size_t rem)
{
	size_t head = (size_t)(NIO_ALIGN_UP(fo) - fo);

	if (!P->direct || !head || (uintptr_t)dest % NIO_ALIGN != fo % NIO_ALIGN)
		return 0;
	return rem > head && rem - head >= P->direct_min ? head : 0;
}

static int plan_next(struct planner *P, struct rop *op)
{
	struct nio_rseg *seg;
	uint64_t fo, bstart, limit, hi;
	size_t rem, take;

	while (P->s < P->nsegs && P->p >= P->segs[P->s].len) {
		P->s++;
		P->p = 0;
	}
	if (P->s == P->nsegs)
		return 0;
	seg = &P->segs[P->s];
	fo = seg->off + P->p;
	rem = seg->len - P->p;
	op->seg_b = P->s;
	op->pos_b = P->p;
	if (to_dest_ok(P, fo, seg->buf + P->p, rem)) {
		take = P->direct ? (size_t)NIO_ALIGN_DOWN((uint64_t)rem) : rem;
		if (take > P->bs)
			take = P->bs;
		op->to_dest = 1;
		op->dest = seg->buf + P->p;
		op->foff = fo;
		op->len = take;
		op->need = take;
		P->p += take;
		op->seg_e = P->s;
		op->pos_e = P->p;
		return 1;
	}
	op->to_dest = 0;
	bstart = NIO_ALIGN_DOWN(fo);
	limit = bstart + P->bs;
	hi = fo;
	for (;;) {
		size_t cut = congruent_head(P, fo, seg->buf + P->p, rem);

		take = limit - fo < rem ? (size_t)(limit - fo) : rem;
		if (cut && cut < take)
			take = cut; /* the aligned rest goes straight into dest next */
		P->p += take;
		if (fo + take > hi)
			hi = fo + take;
		if (P->p < seg->len)
			break; /* segment continues past this block */
		P->s++;
		P->p = 0;
		while (P->s < P->nsegs && P->segs[P->s].len == 0)
			P->s++;
		if (P->s == P->nsegs)
			break;
		seg = &P->segs[P->s];
		fo = seg->off;
		rem = seg->len;
		if (fo < bstart || fo >= limit || to_dest_ok(P, fo, seg->buf, rem))
			break;
	}
	op->seg_e = P->s;
	op->pos_e = P->p;
	op->foff = bstart;
	op->len = (size_t)(NIO_ALIGN_UP(hi) - bstart);
	op->need = op->len;
	if (bstart + op->need > P->file_size)
		op->need = (size_t)(P->file_size - bstart);
	return 1;
}

static void retire(struct nio_rseg *segs, size_t nsegs, const struct rop *op, const char *slot)
{
	size_t last = op->seg_e < nsegs ? op->seg_e : nsegs - 1;

	if (op->to_dest) {
		struct nio_rseg *seg = &segs[op->seg_b];

		seg->crc = nio_crc32c(seg->crc, op->dest, op->len);
		return;
	}
	for (size_t s = op->seg_b; s <= last; s++) {
		size_t p0 = s == op->seg_b ? op->pos_b : 0;
		size_t p1 = s == op->seg_e ? op->pos_e : segs[s].len;

		if (p1 <= p0)
			continue;
		segs[s].crc =
			nio_crc32c_copy(segs[s].buf + p0, slot + (segs[s].off + p0 - op->foff),
					p1 - p0, segs[s].crc);
	}
}

/* Leading segments read in full once op has retired (ops retire in file order). */
static size_t segments_done(const struct nio_rseg *segs, size_t nsegs, const struct rop *op)
{
	size_t s = op->seg_e;

	if (s < nsegs && op->pos_e >= segs[s].len)
		s++;
	while (s < nsegs && segs[s].len == 0)
		s++;
	return s;
}

/*
 * Plan and submit transfers while a ring entry is free and fewer than qd
 * transfers are in flight. Ring entry i owns arena slot i.
 */
static void fill_queue(struct nio_ctx *ctx, struct planner *P, struct rop *ops, int fd, int direct,
		       unsigned *head, unsigned *count, int *planned_all)
{
	while (!*planned_all && *count < ctx->nslots && ctx->inflight < ctx->qd) {
		struct rop *op = &ops[*head];
		struct nio_req *req = &ctx->reqs[*head];

		if (!plan_next(P, op)) {
			*planned_all = 1;
			return;
		}
		nio_req_setup(req, fd, NIO_OP_READ, direct,
			      op->to_dest ? op->dest : nio_slot(ctx, *head), op->foff, op->len,
			      op->need);
		nio_req_start(ctx, req);
		*head = (*head + 1) % ctx->nslots;
		(*count)++;
	}
}

int nio_read_segments(struct nio_ctx *ctx, int fd, int direct, size_t direct_min,
		      uint64_t file_size, struct nio_rseg *segs, size_t nsegs, uint64_t *io_bytes,
		      uint64_t *to_dest_bytes, nio_read_progress_fn progress, void *progress_arg,
		      struct nio_error *e)
{
	struct planner P = {
		.segs = segs,
		.nsegs = nsegs,
		.direct = direct,
		.bs = ctx->block_size,
		.direct_min = direct_min,
		.file_size = file_size,
	};
	unsigned n = ctx->nslots, head = 0, tail = 0, count = 0;
	struct rop *ops;
	int planned_all = 0, cancelled = 0, rc = 0;

	for (size_t i = 0; i < nsegs; i++)
		segs[i].crc = 0;
	ops = calloc(n, sizeof(*ops));
	if (!ops) {
		e->err = ENOMEM;
		e->op = "read (allocating)";
		e->has_off = 0;
		return -1;
	}
	for (unsigned i = 0; i < n; i++)
		ctx->reqs[i].state = NIO_REQ_IDLE;
	ctx->stall_ms =
		0; /* never abandon a read: the kernel would write into the caller's memory */
	for (;;) {
		struct nio_req *req;

		/* keep the queue full */
		fill_queue(ctx, &P, ops, fd, direct, &head, &count, &planned_all);
		if (!count)
			break;
		req = &ctx->reqs[tail];
		rc = nio_wait_req(ctx, req);
		if (rc) {
			e->err = rc;
			e->op = "read (waiting for completion)";
			e->has_off = 0;
			goto fail;
		}
		if (req->err) {
			e->err = req->err;
			e->op = "read";
			e->has_off = 1;
			e->off = req->err_off;
			goto fail;
		}
		/*
		 * The oldest transfer has landed and is no longer in flight:
		 * refill before its copy-out so the device stays busy.
		 */
		fill_queue(ctx, &P, ops, fd, direct, &head, &count, &planned_all);
		retire(segs, nsegs, &ops[tail], nio_slot(ctx, tail));
		*io_bytes += req->done;
		if (ops[tail].to_dest)
			*to_dest_bytes += req->done;
		req->state = NIO_REQ_IDLE;
		if (progress &&
		    progress(progress_arg, segs, segments_done(segs, nsegs, &ops[tail])) &&
		    !cancelled) {
			cancelled = 1;
			planned_all = 1; /* the transfers in flight still land before the return */
		}
		tail = (tail + 1) % n;
		count--;
	}
	free(ops);
	if (cancelled) {
		e->err = ECANCELED;
		e->op = "read (cancelled)";
		e->has_off = 0;
		return -1;
	}
	if (progress)
		progress(progress_arg, segs, nsegs);
	return 0;
fail:
	if (nio_drain(ctx))
		ctx->broken = 1;
	for (unsigned i = 0; i < n; i++)
		ctx->reqs[i].state = NIO_REQ_IDLE;
	free(ops);
	return -1;
}
