// SPDX-License-Identifier: Apache-2.0
/*
 * CRC-32C: the standard check value, incremental == one shot at every split,
 * the fused copy copies exactly and checksums the same, at odd alignments.
 */
#include "nio_test.h"

int main(void)
{
	static const char check[] = "123456789";
	enum { N = 70001 };
	unsigned char *src = malloc(N + 64), *dst = malloc(N + 64);
	uint32_t whole;

	CHECK(src && dst, "malloc");
	nio_crc32c_init();
	CHECK(nio_crc32c(0, check, 9) == 0xE3069283u, "check value is %08x (%s)",
	      nio_crc32c(0, check, 9), nio_crc32c_impl());
	CHECK(nio_crc32c(0, check, 0) == 0, "empty buffer");
	t_fill(src, N + 64, 1);
	whole = nio_crc32c(0, src, N);
	for (size_t split = 0; split <= N; split += 997) {
		uint32_t part = nio_crc32c(nio_crc32c(0, src, split), src + split, N - split);

		CHECK(part == whole, "split at %zu: %08x != %08x", split, part, whole);
	}
	for (size_t shift = 0; shift < 16; shift++) {
		uint32_t want = nio_crc32c(0, src + shift, N - shift);

		memset(dst, 0, N + 64);
		CHECK(nio_crc32c_copy(dst + (15 - shift), src + shift, N - shift, 0) == want,
		      "copy crc, shift %zu", shift);
		CHECK(!memcmp(dst + (15 - shift), src + shift, N - shift), "copy bytes, shift %zu",
		      shift);
		CHECK(dst[15 - shift + N - shift] == 0, "copy wrote past its end, shift %zu",
		      shift);
	}
	free(src);
	free(dst);
	return T_EXIT_PASS;
}
