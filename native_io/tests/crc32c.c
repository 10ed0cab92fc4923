// SPDX-License-Identifier: Apache-2.0
/*
 * CRC-32C: the standard check value, incremental == one shot at every split,
 * the fused copy copies exactly and checksums the same, at odd alignments,
 * short and long (past the lanes, with a tail).
 */
#include "nio_test.h"

/* copy len bytes at every shift of source and destination; nothing around them changes */
static void check_copy(const unsigned char *src, unsigned char *dst, size_t len)
{
	for (size_t shift = 0; shift < 16; shift++) {
		uint32_t want = nio_crc32c(0, src + shift, len);
		unsigned char *d = dst + 1 + (15 - shift);

		memset(dst, 0, len + 64);
		CHECK(nio_crc32c_copy(d, src + shift, len, 0) == want,
		      "copy crc, %zu bytes, shift %zu", len, shift);
		CHECK(!memcmp(d, src + shift, len), "copy bytes, %zu bytes, shift %zu", len, shift);
		CHECK(d[-1] == 0 && d[len] == 0, "copy wrote outside its %zu bytes, shift %zu", len,
		      shift);
	}
}

int main(void)
{
	static const char check[] = "123456789";
	enum { N = 70001, BIG = (3 << 20) + 12345 };
	unsigned char *src = malloc(BIG + 64), *dst = malloc(BIG + 64);
	uint32_t whole;

	CHECK(src && dst, "malloc");
	nio_crc32c_init();
	CHECK(nio_crc32c(0, check, 9) == 0xE3069283u, "check value is %08x (%s)",
	      nio_crc32c(0, check, 9), nio_crc32c_impl());
	CHECK(nio_crc32c(0, check, 0) == 0, "empty buffer");
	t_fill(src, BIG + 64, 1);
	whole = nio_crc32c(0, src, N);
	for (size_t split = 0; split <= N; split += 997) {
		uint32_t part = nio_crc32c(nio_crc32c(0, src, split), src + split, N - split);

		CHECK(part == whole, "split at %zu: %08x != %08x", split, part, whole);
	}
	check_copy(src, dst, N);
	check_copy(src, dst, BIG);
	free(src);
	free(dst);
	return T_EXIT_PASS;
}
