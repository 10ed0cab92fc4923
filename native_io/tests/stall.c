// SPDX-License-Identifier: Apache-2.0
/*
 * Built with NATIVE_IO_TESTING, on each engine, O_DIRECT into a file with a
 * KEEP_SIZE reservation (a checkpoint's writer):
 * - an injected EIO on the third completion is reported as a write error with
 *   its offset, every time, and nothing is left in flight;
 * - a transfer whose completion never comes ends the write with ETIMEDOUT
 *   within the writer's bound instead of a wait without end, and a context
 *   that gave up is destroyed without touching what it abandoned.
 */
#include "nio_test.h"

enum { BLOCK = 64 * 1024, QD = 2, LEN = 8 * BLOCK, ROUNDS = 200, STALL_MS = 200 };

static int open_direct(char *path, size_t len)
{
	int fd = t_tempfile(path, len, O_DIRECT);

	if (fd < 0) {
		printf("skip: O_DIRECT refused in TMPDIR: %s\n", strerror(-fd));
		unlink(path);
	}
	return fd;
}

/* One torn write; returns the error it ended with (0: none). */
static int torn_write(struct nio_ctx *ctx, int fd, const unsigned char *src, long eio_at,
		      long stall_at, unsigned stall_ms, struct nio_error *e)
{
	struct nio_writer w;
	uint32_t crc;
	int rc;

	nio_writer_init(&w, ctx, fd, 1, stall_ms);
	(void)nio_writer_preallocate(&w, 10 * BLOCK); /* refused (no fallocate): goes on without */
	nio_faults_set(0, 0, eio_at, stall_at, 0, 0, 0);
	rc = nio_writer_put(&w, 0, src, LEN, &crc, e) || nio_writer_finish(&w, 1, LEN, e);
	if (rc)
		nio_writer_abort(&w);
	nio_faults_set(0, 0, 0, 0, 0, 0, 0);
	return rc ? e->err : 0;
}

static int engine_case(int kind, const unsigned char *src)
{
	struct nio_error e = { 0 };
	struct nio_ctx *ctx;
	char path[256], why[256] = "";
	uint64_t t0, took_ms;
	int fd, err;

	if (nio_ctx_create(kind, BLOCK, QD, &ctx, why, sizeof(why))) {
		printf("skip: engine %d: %s\n", kind, why);
		return T_EXIT_SKIP;
	}
	fd = open_direct(path, sizeof(path));
	if (fd < 0) {
		nio_ctx_destroy(ctx);
		return T_EXIT_SKIP;
	}
	for (int i = 0; i < ROUNDS; i++) {
		memset(&e, 0, sizeof(e));
		CHECK(!ftruncate(fd, 0), "ftruncate: %s", strerror(errno));
		err = torn_write(ctx, fd, src, 3, 0, NIO_STALL_LIMIT_MS, &e);
		CHECK(err == EIO && e.has_off, "engine %d round %d: error %d (%s)", kind, i, err,
		      e.op ? e.op : "-");
		CHECK(!ctx->inflight && !ctx->broken,
		      "engine %d round %d: %u in flight after abort", kind, i, ctx->inflight);
	}
	printf("ok: engine %d: an EIO on the 3rd of %d O_DIRECT completions reported %d of %d times\n",
	       kind, LEN / BLOCK, ROUNDS, ROUNDS);

	memset(&e, 0, sizeof(e));
	t0 = nio_now_ns();
	err = torn_write(ctx, fd, src, 0, 3, STALL_MS, &e);
	took_ms = (nio_now_ns() - t0) / 1000000u;
	CHECK(err == ETIMEDOUT && e.has_off, "engine %d: a lost completion ended with %d (%s)",
	      kind, err, e.op ? e.op : "-");
	CHECK(took_ms >= STALL_MS, "engine %d: gave up after %llu ms, before the %d ms bound", kind,
	      (unsigned long long)took_ms, STALL_MS);
	CHECK(ctx->stalled && ctx->broken, "engine %d: a context that gave up must not be reused",
	      kind);
	printf("ok: engine %d: a lost completion ended the write with ETIMEDOUT after %llu ms (bound %d ms): %s\n",
	       kind, (unsigned long long)took_ms, STALL_MS, e.op);
	close(fd);
	unlink(path);
	nio_ctx_destroy(ctx);
	return T_EXIT_PASS;
}

int main(void)
{
	unsigned char *src = nio_aligned_alloc(LEN);
	int ran = 0;

	CHECK(src, "alloc");
	nio_crc32c_init();
	t_fill(src, LEN, 11);
	for (int kind = NIO_URING; kind <= NIO_PORTABLE; kind++)
		ran += engine_case(kind, src) == T_EXIT_PASS;
	nio_aligned_free(src, LEN);
	return ran ? T_EXIT_PASS : T_EXIT_SKIP;
}
