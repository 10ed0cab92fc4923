// SPDX-License-Identifier: Apache-2.0
/*
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), standard framing:
 * init ~0, final xor ~0; nio_crc32c(crc32c(a), b) == crc32c(a || b).
 *
 * x86_64 with SSE4.2 uses the crc32 instruction; everything else uses a
 * slicing-by-8 table. nio_crc32c_copy() folds the checksum into the copy so
 * the data is read once (load, crc, store).
 *
 * The crc32 instruction has a 3-cycle latency but issues once per cycle, so a
 * single dependency chain runs at a third of its throughput. Long inputs are
 * therefore cut into blocks of 3 lanes of LANE bytes, checksummed as three
 * independent chains (lane 0 continues the running register, lanes 1 and 2
 * start at 0) and joined with shift(): the raw register advanced over LANE
 * zero bytes, so crc(A || B) = shift(crc(A)) ^ crc0(B) for |B| == LANE.
 */
#include <stdlib.h>
#include <string.h>
#include "nio.h"

#define POLY 0x82F63B78u
#define LANE 8192 /* inputs from 24 KiB up use lanes; one join per 24 KiB is noise */

static uint32_t table[8][256];
/* shift over LANE zero bytes is linear over GF(2): one table per register byte */
static uint32_t shift_lane[4][256];
static int use_hw;

void nio_crc32c_init(void)
{
	uint32_t basis[32];
	const char *env;

	for (unsigned n = 0; n < 256; n++) {
		uint32_t c = n;

		for (int k = 0; k < 8; k++)
			c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
		table[0][n] = c;
	}
	for (unsigned n = 0; n < 256; n++)
		for (int t = 1; t < 8; t++)
			table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xff];
	/* image of each register bit after LANE zero bytes (~0.6 ms at import) */
	for (int i = 0; i < 32; i++) {
		uint32_t c = 1u << i;

		for (int k = 0; k < LANE; k++)
			c = (c >> 8) ^ table[0][c & 0xff];
		basis[i] = c;
	}
	for (int k = 0; k < 4; k++)
		for (unsigned b = 0; b < 256; b++) {
			uint32_t v = 0;

			for (int j = 0; j < 8; j++)
				if (b & (1u << j))
					v ^= basis[8 * k + j];
			shift_lane[k][b] = v;
		}
#if defined(__x86_64__)
	__builtin_cpu_init();
	use_hw = __builtin_cpu_supports("sse4.2");
#endif
	/* NATIVE_IO_CRC32C=software forces the table (tests, benchmarks) */
	env = getenv("NATIVE_IO_CRC32C");
	if (env && !strcmp(env, "software"))
		use_hw = 0;
}

const char *nio_crc32c_impl(void)
{
	return use_hw ? "sse4.2" : "software";
}

/* Raw (unframed) software update. */
static uint32_t sw_update(uint32_t c, const unsigned char *p, size_t len)
{
	while (len && ((uintptr_t)p & 7)) {
		c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
		len--;
	}
	while (len >= 8) {
		uint64_t v;

		memcpy(&v, p, 8);
		v ^= c; /* little endian only; big endian takes the byte loop */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
		c = table[7][v & 0xff] ^ table[6][(v >> 8) & 0xff] ^ table[5][(v >> 16) & 0xff] ^
		    table[4][(v >> 24) & 0xff] ^ table[3][(v >> 32) & 0xff] ^
		    table[2][(v >> 40) & 0xff] ^ table[1][(v >> 48) & 0xff] ^ table[0][v >> 56];
		p += 8;
		len -= 8;
#else
		break;
#endif
	}
	while (len--)
		c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
	return c;
}

static uint32_t sw_copy(unsigned char *d, const unsigned char *s, size_t len, uint32_t c)
{
	/* copy in cache-sized chunks and checksum the chunk while it is hot */
	while (len) {
		size_t n = len < 16384 ? len : 16384;

		memcpy(d, s, n);
		c = sw_update(c, d, n);
		d += n;
		s += n;
		len -= n;
	}
	return c;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

static uint32_t shift(uint32_t c)
{
	return shift_lane[0][c & 0xff] ^ shift_lane[1][(c >> 8) & 0xff] ^
	       shift_lane[2][(c >> 16) & 0xff] ^ shift_lane[3][c >> 24];
}

/*
 * One block of 3 * LANE bytes as three chains; also stores to d unless d is
 * NULL (always inlined, so the test folds away).
 */
__attribute__((target("sse4.2"), always_inline)) static inline uint64_t
hw_block(unsigned char *d, const unsigned char *s, uint64_t c0)
{
	uint64_t c1 = 0, c2 = 0;

	for (size_t i = 0; i < LANE; i += 8) {
		uint64_t a, b, e;

		memcpy(&a, s + i, 8);
		memcpy(&b, s + LANE + i, 8);
		memcpy(&e, s + 2 * LANE + i, 8);
		c0 = _mm_crc32_u64(c0, a);
		c1 = _mm_crc32_u64(c1, b);
		c2 = _mm_crc32_u64(c2, e);
		if (d) {
			memcpy(d + i, &a, 8);
			memcpy(d + LANE + i, &b, 8);
			memcpy(d + 2 * LANE + i, &e, 8);
		}
	}
	return shift(shift((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t c, const unsigned char *p,
							    size_t len)
{
	uint64_t c64;

	while (len && ((uintptr_t)p & 7)) {
		c = _mm_crc32_u8(c, *p++);
		len--;
	}
	c64 = c;
	for (; len >= 3 * LANE; p += 3 * LANE, len -= 3 * LANE)
		c64 = hw_block(NULL, p, c64);
	while (len >= 8) {
		uint64_t v;

		memcpy(&v, p, 8);
		c64 = _mm_crc32_u64(c64, v);
		p += 8;
		len -= 8;
	}
	c = (uint32_t)c64;
	while (len--)
		c = _mm_crc32_u8(c, *p++);
	return c;
}

__attribute__((target("sse4.2"))) static uint32_t hw_copy(unsigned char *d, const unsigned char *s,
							  size_t len, uint32_t c)
{
	uint64_t c64;

	/*
	 * Align the stores, not the loads: with src and dst out of step, the
	 * three split-line store streams cost the lanes their gain (measured).
	 */
	while (len && ((uintptr_t)d & 7)) {
		c = _mm_crc32_u8(c, *s);
		*d++ = *s++;
		len--;
	}
	c64 = c;
	for (; len >= 3 * LANE; s += 3 * LANE, d += 3 * LANE, len -= 3 * LANE)
		c64 = hw_block(d, s, c64);
	while (len >= 32) {
		uint64_t a, b, e, f;

		memcpy(&a, s, 8);
		memcpy(&b, s + 8, 8);
		memcpy(&e, s + 16, 8);
		memcpy(&f, s + 24, 8);
		c64 = _mm_crc32_u64(c64, a);
		c64 = _mm_crc32_u64(c64, b);
		c64 = _mm_crc32_u64(c64, e);
		c64 = _mm_crc32_u64(c64, f);
		memcpy(d, &a, 8);
		memcpy(d + 8, &b, 8);
		memcpy(d + 16, &e, 8);
		memcpy(d + 24, &f, 8);
		s += 32;
		d += 32;
		len -= 32;
	}
	while (len >= 8) {
		uint64_t a;

		memcpy(&a, s, 8);
		c64 = _mm_crc32_u64(c64, a);
		memcpy(d, &a, 8);
		s += 8;
		d += 8;
		len -= 8;
	}
	c = (uint32_t)c64;
	while (len--) {
		c = _mm_crc32_u8(c, *s);
		*d++ = *s++;
	}
	return c;
}
#endif

uint32_t nio_crc32c(uint32_t crc, const void *buf, size_t len)
{
	uint32_t c = ~crc;

#if defined(__x86_64__)
	if (use_hw)
		return ~hw_update(c, buf, len);
#endif
	return ~sw_update(c, buf, len);
}

uint32_t nio_crc32c_copy(void *dst, const void *src, size_t len, uint32_t crc)
{
	uint32_t c = ~crc;

	if (!len)
		return crc;
#if defined(__x86_64__)
	if (use_hw)
		return ~hw_copy(dst, src, len, c);
#endif
	return ~sw_copy(dst, src, len, c);
}
