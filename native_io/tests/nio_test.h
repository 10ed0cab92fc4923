/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Helpers of the C tests: one small program per behaviour (liburing's style),
 * exit 0 on success, 1 on failure, 77 when the behaviour cannot be tested here.
 */
#ifndef NIO_TEST_H
#define NIO_TEST_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* O_DIRECT */
#endif

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "../src/nio.h"

#define T_EXIT_PASS 0
#define T_EXIT_FAIL 1
#define T_EXIT_SKIP 77

#define CHECK(cond, ...)                                                                         \
	do {                                                                                     \
		if (!(cond)) {                                                                   \
			fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                            \
			fputc('\n', stderr);                                                     \
			exit(T_EXIT_FAIL);                                                       \
		}                                                                                \
	} while (0)

/* A deterministic byte pattern (xorshift), so a misplaced block shows. */
static inline void t_fill(unsigned char *buf, size_t len, uint64_t seed)
{
	uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;

	for (size_t i = 0; i < len; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = (unsigned char)x;
	}
}

/* A temporary file in TMPDIR (or /tmp), unlinked at once; returns its path in path. */
static inline int t_tempfile(char *path, size_t len, int flags)
{
	const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
	int fd, tmp;

	snprintf(path, len, "%s/nio-test-XXXXXX", dir);
	tmp = mkstemp(path);
	CHECK(tmp >= 0, "mkstemp(%s): %s", path, strerror(errno));
	close(tmp);
	fd = open(path, O_RDWR | flags);
	if (fd < 0 && (flags & O_DIRECT))
		return -errno; /* the filesystem may refuse O_DIRECT (tmpfs) */
	CHECK(fd >= 0, "open(%s): %s", path, strerror(errno));
	return fd;
}

/* The whole file read back with pread, checked against expect[0..len). */
static inline void t_expect_file(const char *path, const unsigned char *expect, size_t len)
{
	unsigned char *got = malloc(len + 1);
	int fd = open(path, O_RDONLY);
	size_t done = 0;
	off_t size;

	CHECK(got && fd >= 0, "open(%s): %s", path, strerror(errno));
	size = lseek(fd, 0, SEEK_END);
	CHECK(size == (off_t)len, "%s has %lld bytes, expected %zu", path, (long long)size, len);
	while (done < len) {
		ssize_t n = pread(fd, got + done, len - done, (off_t)done);

		CHECK(n > 0, "pread(%s) at %zu: %s", path, done, n < 0 ? strerror(errno) : "EOF");
		done += (size_t)n;
	}
	for (size_t i = 0; i < len; i++)
		CHECK(got[i] == expect[i], "%s: byte %zu is %u, expected %u", path, i, got[i],
		      expect[i]);
	close(fd);
	free(got);
}

/*
 * run(kind, direct) on every engine, buffered and O_DIRECT: the first failure
 * ends the program; it passes if any combination ran, else it is skipped.
 */
static inline int t_each_engine_and_mode(int (*run)(int kind, int direct))
{
	int ran = 0;

	for (int kind = NIO_URING; kind <= NIO_PORTABLE; kind++) {
		for (int direct = 0; direct <= 1; direct++) {
			int rc = run(kind, direct);

			if (rc == T_EXIT_FAIL)
				return rc;
			ran += rc == T_EXIT_PASS;
		}
	}
	return ran ? T_EXIT_PASS : T_EXIT_SKIP;
}

#endif /* NIO_TEST_H */
