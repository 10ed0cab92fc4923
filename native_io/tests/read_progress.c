// SPDX-License-Identifier: Apache-2.0
/*
 * A read's progress callback: the leading segments it reports as done are
 * already byte-exact with their final CRC-32C, the count only grows and ends
 * at every segment (empty ones too); a callback that returns nonzero cancels
 * the read with ECANCELED once the transfers in flight have landed, and the
 * context reads the file whole afterwards. On each engine, buffered and O_DIRECT.
 */
#include "nio_test.h"

enum { NSEG = 60, BLOCK = 64 * 1024, QD = 2 };

struct watch {
	const unsigned char *src;
	size_t calls, done, cancel_after;
	int cancelled;
};

static int on_progress(void *arg, const struct nio_rseg *segs, size_t done)
{
	struct watch *w = arg;

	CHECK(done >= w->done, "progress went back from %zu to %zu", w->done, done);
	CHECK(done <= NSEG, "progress %zu past the %d segments", done, NSEG);
	for (size_t i = w->done; i < done; i++) {
		CHECK(!memcmp(segs[i].buf, w->src + segs[i].off, segs[i].len),
		      "segment %zu reported done before its bytes landed", i);
		CHECK(segs[i].crc == nio_crc32c(0, w->src + segs[i].off, segs[i].len),
		      "segment %zu reported done before its crc was final", i);
	}
	w->done = done;
	w->calls++;
	if (w->cancel_after && w->calls >= w->cancel_after)
		w->cancelled = 1;
	return w->cancelled;
}

static int read_all(struct nio_ctx *ctx, int fd, int direct, size_t size, struct nio_rseg *rsegs,
		    struct watch *w, struct nio_error *e)
{
	uint64_t io_bytes = 0, to_dest = 0;

	for (int i = 0; i < NSEG; i++)
		memset(rsegs[i].buf, 0, rsegs[i].len);
	return nio_read_segments(ctx, fd, direct, NIO_READ_DIRECT_MIN, size, rsegs, NSEG, &io_bytes,
				 &to_dest, on_progress, w, e);
}

static int run(int kind, int direct)
{
	struct nio_rseg rsegs[NSEG];
	struct nio_error e = { 0 };
	struct nio_ctx *ctx;
	struct watch w = { 0 };
	unsigned char *src;
	uint64_t off = 0;
	size_t size, done_at_cancel;
	char path[256], why[256] = "";
	int fd;

	/* small and large segments, empty ones, gaps; some start 4096-aligned */
	for (int i = 0; i < NSEG; i++) {
		off += (i % 4 == 1) ? 3 * BLOCK + 7 : (uint64_t)(i % 3) * 13;
		if (i % 6 == 0)
			off = NIO_ALIGN_UP(off);
		rsegs[i].off = off;
		rsegs[i].len = i % 9 == 4 ? 0 :
					    (i % 5 == 0 ? (size_t)(2 * BLOCK + 31 * i) :
							  1 + (size_t)(i * 4099) % 7000);
		off += rsegs[i].len;
	}
	size = (size_t)off;
	src = malloc(size);
	CHECK(src, "malloc");
	t_fill(src, size, 7 + (uint64_t)kind * 2 + (uint64_t)direct);
	if (nio_ctx_create(kind, BLOCK, QD, &ctx, why, sizeof(why))) {
		printf("skip: engine %d: %s\n", kind, why);
		free(src);
		return T_EXIT_SKIP;
	}
	fd = t_tempfile(path, sizeof(path), 0);
	CHECK(pwrite(fd, src, size, 0) == (ssize_t)size, "pwrite: %s", strerror(errno));
	CHECK(!fsync(fd), "fsync");
	close(fd);
	fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
	if (fd < 0) {
		printf("skip: O_DIRECT refused in TMPDIR: %s\n", strerror(errno));
		unlink(path);
		nio_ctx_destroy(ctx);
		free(src);
		return T_EXIT_SKIP;
	}
	for (int i = 0; i < NSEG; i++) {
		rsegs[i].buf = malloc(rsegs[i].len + 1);
		CHECK(rsegs[i].buf, "malloc");
	}
	w.src = src;
	CHECK(!read_all(ctx, fd, direct, size, rsegs, &w, &e), "read: %s at %s", strerror(e.err),
	      e.op);
	CHECK(w.done == NSEG && w.calls > 2,
	      "the last report covers every segment (%zu of %d, %zu reports)", w.done, NSEG,
	      w.calls);

	memset(&w, 0, sizeof(w));
	w.src = src;
	w.cancel_after = 2;
	CHECK(read_all(ctx, fd, direct, size, rsegs, &w, &e) == -1 && e.err == ECANCELED,
	      "a cancelled read fails with ECANCELED (got %s)", strerror(e.err));
	done_at_cancel = w.done;
	CHECK(done_at_cancel < NSEG, "cancelled after %zu reports, yet all %d segments were read",
	      w.calls, NSEG);

	memset(&w, 0, sizeof(w));
	w.src = src;
	CHECK(!read_all(ctx, fd, direct, size, rsegs, &w, &e), "read after a cancel: %s at %s",
	      strerror(e.err), e.op);
	CHECK(w.done == NSEG, "the read after a cancel reached %zu of %d segments", w.done, NSEG);
	for (int i = 0; i < NSEG; i++)
		free(rsegs[i].buf);
	close(fd);
	unlink(path);
	nio_ctx_destroy(ctx);
	free(src);
	printf("ok: engine %d direct %d: %zu bytes, cancelled at %zu of %d segments\n", kind,
	       direct, size, done_at_cancel, NSEG);
	return T_EXIT_PASS;
}

int main(void)
{
	nio_crc32c_init();
	return t_each_engine_and_mode(run);
}
