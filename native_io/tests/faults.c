// SPDX-License-Identifier: Apache-2.0
/*
 * Built with NATIVE_IO_TESTING: short transfers and EINTR are requeued until
 * every byte lands (liburing's "short read/write, adjust and requeue"), and
 * an injected EIO is reported as a write error with its file offset, on
 * each engine.
 */
#include "nio_test.h"

enum { LEN = 1000003, BLOCK = 64 * 1024, QD = 2 };

static int roundtrip(int kind, long short_every, long eintr_every, long eio_at, struct nio_error *e)
{
	unsigned char *src = malloc(LEN);
	struct nio_writer w;
	struct nio_ctx *ctx;
	char path[256], why[256] = "";
	uint32_t crc;
	int fd, rc;

	CHECK(src, "malloc");
	t_fill(src, LEN, 7);
	if (nio_ctx_create(kind, BLOCK, QD, &ctx, why, sizeof(why))) {
		printf("skip: engine %d: %s\n", kind, why);
		free(src);
		return T_EXIT_SKIP;
	}
	fd = t_tempfile(path, sizeof(path), 0);
	nio_faults_set(short_every, eintr_every, eio_at, 0, 0, 0, 0);
	nio_writer_init(&w, ctx, fd, 0, NIO_STALL_LIMIT_MS);
	rc = nio_writer_put(&w, 0, src, LEN, &crc, e) || nio_writer_finish(&w, 1, LEN, e);
	if (rc)
		nio_writer_abort(&w);
	nio_faults_set(0, 0, 0, 0, 0, 0, 0);
	if (!rc) {
		CHECK(crc == nio_crc32c(0, src, LEN), "crc");
		t_expect_file(path, src, LEN);
	}
	close(fd);
	unlink(path);
	nio_ctx_destroy(ctx);
	free(src);
	return rc ? -1 : T_EXIT_PASS;
}

int main(void)
{
	int ran = 0;

	nio_crc32c_init();
	for (int kind = NIO_URING; kind <= NIO_PORTABLE; kind++) {
		struct nio_error e = { 0 };
		int rc = roundtrip(kind, 3, 5, 0, &e);

		if (rc == T_EXIT_SKIP)
			continue;
		CHECK(rc == T_EXIT_PASS, "engine %d with short writes and EINTR: %s at %s", kind,
		      strerror(e.err), e.op);
		memset(&e, 0, sizeof(e));
		rc = roundtrip(kind, 0, 0, 4, &e);
		CHECK(rc == -1, "engine %d: the injected EIO was not reported", kind);
		CHECK(e.err == EIO && e.has_off, "engine %d: error %d (%s) has_off %d", kind, e.err,
		      e.op, e.has_off);
		printf("ok: engine %d: requeued short/EINTR transfers; EIO reported at %s, offset %llu\n",
		       kind, e.op, (unsigned long long)e.off);
		ran++;
	}
	return ran ? T_EXIT_PASS : T_EXIT_SKIP;
}
