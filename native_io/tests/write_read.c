// SPDX-License-Identifier: Apache-2.0
/*
 * Segments with gaps written through the coalescing writer (staged, and
 * unstaged from aligned memory under O_DIRECT) read back byte for byte by
 * pread and by nio_read_segments, with every CRC-32C right, on each engine
 * this build has and this machine allows, buffered and O_DIRECT.
 */
#include "nio_test.h"

enum { NSEG = 40, BLOCK = 64 * 1024, QD = 3 };

struct seg {
	uint64_t off;
	size_t len;
	int unstaged;
};

/* Segments in file order: small and large, gaps inside and across blocks, some aligned bodies. */
static size_t plan(struct seg *segs, int direct)
{
	uint64_t off = 0;

	for (int i = 0; i < NSEG; i++) {
		size_t len =
			(i % 5 == 0) ? (size_t)(3 * BLOCK + 17 * i) : 1 + (size_t)(i * 7919) % 9000;
		uint64_t gap = (i % 7 == 3) ? 2 * BLOCK + 5 : (uint64_t)(i % 3) * 11;

		off += gap;
		segs[i].unstaged = direct && i % 5 == 0;
		if (segs[i].unstaged)
			off = NIO_ALIGN_UP(off);
		segs[i].off = off;
		segs[i].len = len;
		off += len;
	}
	return (size_t)off;
}

static int run(int kind, int direct)
{
	struct seg segs[NSEG];
	size_t size = plan(segs, direct);
	unsigned char *expect = calloc(1, size), *src = nio_aligned_alloc(NIO_ALIGN_UP(size));
	uint32_t crcs[NSEG];
	struct nio_rseg rsegs[NSEG];
	struct nio_error e = { 0 };
	struct nio_writer w;
	struct nio_ctx *ctx;
	uint64_t io_bytes = 0, to_dest = 0;
	size_t payload = 0;
	char path[256], why[256] = "";
	int fd, err;

	CHECK(expect && src, "alloc");
	t_fill(src, size, (uint64_t)kind * 2 + (uint64_t)direct);
	err = nio_ctx_create(kind, BLOCK, QD, &ctx, why, sizeof(why));
	if (err) {
		printf("skip: engine %d: %s\n", kind, why);
		free(expect);
		nio_aligned_free(src, NIO_ALIGN_UP(size));
		return T_EXIT_SKIP;
	}
	fd = t_tempfile(path, sizeof(path), direct ? O_DIRECT : 0);
	if (fd < 0) {
		printf("skip: O_DIRECT refused in TMPDIR: %s\n", strerror(-fd));
		unlink(path);
		nio_ctx_destroy(ctx);
		free(expect);
		nio_aligned_free(src, NIO_ALIGN_UP(size));
		return T_EXIT_SKIP;
	}
	nio_writer_init(&w, ctx, fd, direct, NIO_STALL_LIMIT_MS);
	for (int i = 0; i < NSEG; i++) {
		const unsigned char *body = src + segs[i].off;
		int rc;

		memcpy(expect + segs[i].off, body, segs[i].len);
		if (segs[i].unstaged)
			rc = nio_writer_put_unstaged(&w, segs[i].off, body, segs[i].len, 0,
						     &crcs[i], &e);
		else
			rc = nio_writer_put(&w, segs[i].off, body, segs[i].len, &crcs[i], &e);
		CHECK(!rc, "put %d: %s at %s", i, strerror(e.err), e.op);
		CHECK(crcs[i] == nio_crc32c(0, body, segs[i].len), "crc of segment %d", i);
	}
	CHECK(!nio_writer_finish(&w, 1, size, &e), "finish: %s at %s", strerror(e.err), e.op);
	t_expect_file(path, expect, size);

	for (int i = 0; i < NSEG; i++) {
		rsegs[i].off = segs[i].off;
		rsegs[i].len = segs[i].len;
		rsegs[i].buf = malloc(segs[i].len);
		CHECK(rsegs[i].buf, "malloc");
	}
	CHECK(!nio_read_segments(ctx, fd, direct, NIO_READ_DIRECT_MIN, size, rsegs, NSEG, &io_bytes,
				 &to_dest, NULL, NULL, &e),
	      "read: %s at %s", strerror(e.err), e.op);
	for (int i = 0; i < NSEG; i++) {
		payload += segs[i].len;
		CHECK(!memcmp(rsegs[i].buf, src + segs[i].off, segs[i].len), "read segment %d", i);
		CHECK(rsegs[i].crc == crcs[i], "read crc of segment %d", i);
		free(rsegs[i].buf);
	}
	CHECK(io_bytes >= payload, "read %llu bytes for %zu of segments",
	      (unsigned long long)io_bytes, payload);
	close(fd);
	unlink(path);
	nio_ctx_destroy(ctx);
	free(expect);
	nio_aligned_free(src, NIO_ALIGN_UP(size));
	printf("ok: engine %d direct %d: %zu bytes\n", kind, direct, size);
	return T_EXIT_PASS;
}

int main(void)
{
	nio_crc32c_init();
	return t_each_engine_and_mode(run);
}
