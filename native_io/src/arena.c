// SPDX-License-Identifier: Apache-2.0
/*
 * Staging arena and I/O context lifecycle.
 *
 * The arena is (qd + 1) blocks of block_size bytes, 4096-aligned, allocated
 * once per context; contexts are cached by the engine and reused for the
 * next file, so a process writing many checkpoints allocates it once.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "nio.h"

#define HUGE_ALIGN (2u << 20)

/*
 * size bytes at a 2 MiB boundary, asked to be backed by transparent huge
 * pages (MADV_HUGEPAGE: the kernel's default THP mode is often "madvise").
 * An O_DIRECT transfer from 4 KiB pages becomes one block-layer segment per
 * page, and a device with few segments per request (virtio-blk: 254) splits
 * it into ~1 MiB requests; from huge pages it goes in requests as large as
 * the device takes. Without THP the arena is plain pages, as before.
 */
void *nio_aligned_alloc(size_t size)
{
	size_t span = size + HUGE_ALIGN;
	char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char *a;

	if (p == MAP_FAILED)
		return NULL;
	a = (char *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
	/* give back the slack before and after the aligned span */
	if (a > p)
		munmap(p, (size_t)(a - p));
	if (p + span > a + size)
		munmap(a + size, (size_t)(p + span - (a + size)));
#ifdef MADV_HUGEPAGE
	madvise(a, size, MADV_HUGEPAGE); /* advisory: refused (no THP) is fine */
#endif
	return a; /* 2 MiB aligned, so NIO_ALIGN aligned */
}

void nio_aligned_free(void *p, size_t size)
{
	if (p && munmap(p, size))
		perror("native_io: munmap");
}

int nio_ctx_create(int kind, size_t block_size, unsigned qd, struct nio_ctx **out, char *why,
		   size_t whylen)
{
	struct nio_ctx *ctx;
	int err;

	*out = NULL;
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx) {
		snprintf(why, whylen, "out of memory");
		return ENOMEM;
	}
	ctx->kind = kind;
	ctx->pid = getpid();
	ctx->block_size = block_size;
	ctx->qd = qd;
	ctx->nslots = qd + 1;
	ctx->nreqs = ctx->nslots > NIO_WRITE_REQS ? ctx->nslots : NIO_WRITE_REQS;
	ctx->arena_size = (size_t)ctx->nslots * block_size;
	ctx->reqs = calloc(ctx->nreqs, sizeof(*ctx->reqs));
	ctx->iovs = calloc((size_t)ctx->nreqs * 2 * NIO_MAX_IOV, sizeof(*ctx->iovs));
	ctx->arena = nio_aligned_alloc(ctx->arena_size);
	if (!ctx->reqs || !ctx->iovs || !ctx->arena) {
		snprintf(why, whylen, "cannot allocate %zu byte staging arena", ctx->arena_size);
		err = ENOMEM;
		goto fail;
	}
	for (unsigned i = 0; i < ctx->nreqs; i++) {
		ctx->reqs[i].iov = ctx->iovs + (size_t)i * 2 * NIO_MAX_IOV;
		ctx->reqs[i].sub_iov = ctx->reqs[i].iov + NIO_MAX_IOV;
	}
	if (kind == NIO_URING)
		err = nio_uring_init(ctx, why, whylen);
	else
		err = nio_portable_init(ctx, why, whylen);
	if (err)
		goto fail;
	*out = ctx;
	return 0;
fail:
	nio_aligned_free(ctx->arena, ctx->arena_size);
	free(ctx->iovs);
	free(ctx->reqs);
	free(ctx);
	return err;
}

void nio_ctx_destroy(struct nio_ctx *ctx)
{
	if (!ctx)
		return;
	/* never free memory the kernel may still write into */
	if (ctx->inflight && nio_drain(ctx))
		ctx->broken = 1;
	if (ctx->be)
		ctx->be->destroy(ctx);
	if (ctx->inflight > ctx->phantoms) {
		/* backend could not be drained: leak rather than corrupt */
		fprintf(stderr, "native_io: leaking arena with %u transfers in flight\n",
			ctx->inflight - ctx->phantoms);
		return;
	}
	nio_aligned_free(ctx->arena, ctx->arena_size);
	free(ctx->iovs);
	free(ctx->reqs);
	free(ctx);
}
