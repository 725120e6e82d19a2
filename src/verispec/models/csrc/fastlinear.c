/*
 * fastlinear.c -- few-row fp32 linear layer  y = x @ W.T (+ bias)
 *
 * Built on first use by verispec.models.fastlinear (gcc -O3 -march=native
 * -fopenmp -shared), loaded through ctypes.  Not a Python extension module:
 * plain C ABI, every size is int64_t, every pointer is a raw torch data_ptr.
 *
 * Weight layout ("panels"): W [out, in] is repacked into
 *     Wp [npanels][in][16]        npanels = ceil(out / 16)
 * i.e. 16 consecutive output features are interleaved, one 64-byte vector per
 * input index k.  The last panel is zero-padded.  A thread therefore streams
 * one contiguous block of memory, and each 64-byte weight vector that comes in
 * from DRAM is used for all N input rows before it is dropped (register
 * blocking over rows, R <= 8 rows x P <= 4 panels of accumulators).
 *
 * Summation order (the batch-invariance contract): every output element
 *     y[n][o] = fl(... fma(W[o][1], x[n][1], fma(W[o][0], x[n][0], 0)) ...) + bias[o]
 * is one fp32 accumulator updated with FMA in increasing k, bias added last.
 * That order does not depend on N, on the row/panel blocking that N selects,
 * or on the number of threads (threads split the output dimension only), so
 * row n's result is bitwise the same whatever other rows share the call.
 */
#include <stdint.h>
#include <stddef.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FL_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FL_ISA "avx2"
#else
#include <math.h>
#define FL_ISA "generic"
#endif

#define FL_PW 16   /* panel width (output features per panel) */
#define FL_RMAX 8  /* max rows per register block */
#define FL_PMAX 4  /* max panels per register block */
#ifndef FL_KB
#define FL_KB 2048 /* k block when several row blocks share a panel slice */
#endif

#define FL_INLINE static inline __attribute__((always_inline))
/* fully unroll the (compile-time) row/panel loops so accumulators live in registers */
#define FL_UNROLL _Pragma("GCC unroll 16")
/* Software prefetch of the weight stream, FL_PFD k steps (64-byte lines)
 * ahead.  Only for blocks with 1-2 panels: with 3-4 concurrent streams the
 * hardware prefetcher keeps up by itself and the extra loads cost (measured).
 * Prefetching past the end of a panel is harmless (prefetches never fault). */
#ifndef FL_PFD
#define FL_PFD 16
#endif
#define FL_PREFETCH(P, ptr)                                                   \
    do {                                                                      \
        if (FL_PFD > 0 && (P) <= 2)                                           \
            __builtin_prefetch((const void *)(ptr), 0, 3);                    \
    } while (0)

const char *fl_isa(void) { return FL_ISA; }
int fl_abi_version(void) { return 3; }

/* ------------------------------------------------------------------------ */
/* threads                                                                   */
/* ------------------------------------------------------------------------ */

/* fn(ctx, c) for c in [0, nchunks), on up to nt threads (the caller's + helpers) */
typedef void (*fl_chunk_fn)(const void *ctx, int64_t c);

/*
 * OpenMP.  Built with -fopenmp, the library needs libgomp.so.1; loaded into a
 * process that already has torch's bundled libgomp.so.1 (same soname) it
 * binds to that one, so these threads ARE torch's intra-op threads: no second
 * pool competing for the cores.  Chunks are claimed dynamically.
 */
const char *fl_threading(void)
{
#ifdef _OPENMP
    return "openmp";
#else
    return "serial";
#endif
}

static void fl_parallel(fl_chunk_fn fn, const void *ctx, int64_t nchunks, int nt)
{
    if (nt <= 1 || nchunks <= 1) {
        for (int64_t c = 0; c < nchunks; c++)
            fn(ctx, c);
        return;
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunks; c++)
        fn(ctx, c);
}

/* ------------------------------------------------------------------------ */
/* packing                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct {
    const float *src;
    int64_t ld, out, in, np;
    float *dst;
} fl_pack_t;

#define FL_PACK_CHUNK 16 /* panels per chunk */

static void fl_pack_chunk(const void *vctx, int64_t c)
{
    const fl_pack_t *q = (const fl_pack_t *)vctx;
    const int64_t in = q->in, out = q->out;
    const int64_t pa = c * FL_PACK_CHUNK;
    const int64_t pb = (pa + FL_PACK_CHUNK) < q->np ? (pa + FL_PACK_CHUNK) : q->np;
    for (int64_t p = pa; p < pb; p++) {
        float *dst = q->dst + p * in * FL_PW;
        const int64_t o0 = p * FL_PW;
        const int64_t nv = (out - o0) < FL_PW ? (out - o0) : FL_PW;
        for (int64_t k0 = 0; k0 < in; k0 += 256) {
            const int64_t k1 = (k0 + 256) < in ? (k0 + 256) : in;
            for (int64_t j = 0; j < FL_PW; j++) {
                if (j < nv) {
                    const float *src = q->src + (o0 + j) * q->ld;
                    for (int64_t k = k0; k < k1; k++)
                        dst[k * FL_PW + j] = src[k];
                } else {
                    for (int64_t k = k0; k < k1; k++)
                        dst[k * FL_PW + j] = 0.0f;
                }
            }
        }
    }
}

static void fl_unpack_chunk(const void *vctx, int64_t c)
{
    const fl_pack_t *q = (const fl_pack_t *)vctx;
    const int64_t in = q->in, out = q->out;
    const int64_t pa = c * FL_PACK_CHUNK;
    const int64_t pb = (pa + FL_PACK_CHUNK) < q->np ? (pa + FL_PACK_CHUNK) : q->np;
    for (int64_t p = pa; p < pb; p++) {
        const float *src = q->src + p * in * FL_PW;
        const int64_t o0 = p * FL_PW;
        const int64_t nv = (out - o0) < FL_PW ? (out - o0) : FL_PW;
        for (int64_t j = 0; j < nv; j++) {
            float *dst = q->dst + (o0 + j) * q->ld;
            for (int64_t k = 0; k < in; k++)
                dst[k] = src[k * FL_PW + j];
        }
    }
}

/* W [out][in] with row stride ldw  ->  Wp [np][in][16] (zero padded) */
void fl_pack(const float *W, int64_t ldw, int64_t out, int64_t in, float *Wp,
             int nthreads)
{
    fl_pack_t q = {W, ldw, out, in, (out + FL_PW - 1) / FL_PW, Wp};
    if (out <= 0 || in <= 0)
        return;
    fl_parallel(fl_pack_chunk, &q, (q.np + FL_PACK_CHUNK - 1) / FL_PACK_CHUNK,
                nthreads);
}

/* Wp [np][in][16] -> W [out][in] with row stride ldw (inverse of fl_pack) */
void fl_unpack(const float *Wp, int64_t out, int64_t in, float *W, int64_t ldw,
               int nthreads)
{
    fl_pack_t q = {Wp, ldw, out, in, (out + FL_PW - 1) / FL_PW, W};
    if (out <= 0 || in <= 0)
        return;
    fl_parallel(fl_unpack_chunk, &q, (q.np + FL_PACK_CHUNK - 1) / FL_PACK_CHUNK,
                nthreads);
}

/* ------------------------------------------------------------------------ */
/* micro kernels                                                             */
/* ------------------------------------------------------------------------ */

typedef void (*fl_kern_t)(const float *x, int64_t ldx, const float *wp,
                          int64_t ps, int64_t kn, float *y, int64_t ldy,
                          const float *bias, int64_t o0, int64_t out,
                          int first, int last);

/*
 * One register block: R rows x P panels over the k range [k0, k0 + kn).
 *   x     -> x[r0][k0]               (row stride ldx, unit stride along k)
 *   wp    -> Wp[p0][k0][0]           (panel stride ps = in * 16)
 *   y     -> y[r0][0]                (row stride ldy); columns o0 + [0, 16P)
 *            clipped to out.  Holds the running fp32 partial sums between
 *            k blocks (first == 0 reloads them), the bias is added only
 *            after the last k block.  Storing / reloading an fp32 partial
 *            sum is exact, so k blocking never changes the result.
 */
#if defined(__AVX512F__)

FL_INLINE void fl_kern_body(const int R, const int P, const float *x,
                            int64_t ldx, const float *wp, int64_t ps,
                            int64_t kn, float *y, int64_t ldy,
                            const float *bias, int64_t o0, int64_t out,
                            int first, int last)
{
    __m512 acc[FL_RMAX][FL_PMAX];
    __mmask16 msk[FL_PMAX];
    FL_UNROLL
    for (int p = 0; p < P; p++) {
        const int64_t c = o0 + p * FL_PW;
        const int64_t nv = (out - c) < FL_PW ? (out - c) : FL_PW;
        msk[p] = (__mmask16)((nv >= 16) ? 0xFFFFu : ((1u << nv) - 1u));
    }
    FL_UNROLL
    for (int r = 0; r < R; r++)
        FL_UNROLL
        for (int p = 0; p < P; p++)
            acc[r][p] = first ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(msk[p], y + r * ldy + o0 + p * FL_PW);
    for (int64_t k = 0; k < kn; k++) {
        __m512 w[FL_PMAX];
        FL_UNROLL
        for (int p = 0; p < P; p++) {
            w[p] = _mm512_loadu_ps(wp + p * ps + k * FL_PW);
            FL_PREFETCH(P, wp + p * ps + (k + FL_PFD) * FL_PW);
        }
        FL_UNROLL
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
            FL_UNROLL
            for (int p = 0; p < P; p++)
                acc[r][p] = _mm512_fmadd_ps(w[p], xb, acc[r][p]);
        }
    }
    FL_UNROLL
    for (int p = 0; p < P; p++) {
        const int64_t c = o0 + p * FL_PW;
        const int addb = last && bias;
        const __m512 b = addb ? _mm512_maskz_loadu_ps(msk[p], bias + c) : _mm512_setzero_ps();
        FL_UNROLL
        for (int r = 0; r < R; r++) {
            __m512 v = acc[r][p];
            if (addb)
                v = _mm512_add_ps(v, b);
            _mm512_mask_storeu_ps(y + r * ldy + c, msk[p], v);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

FL_INLINE void fl_kern_body(const int R, const int P, const float *x,
                            int64_t ldx, const float *wp, int64_t ps,
                            int64_t kn, float *y, int64_t ldy,
                            const float *bias, int64_t o0, int64_t out,
                            int first, int last)
{
    /* a 16-wide panel is two ymm halves: h = 2p (columns 0-7), 2p+1 (8-15) */
    __m256 acc[FL_RMAX][2 * FL_PMAX];
    __m256i msk[2 * FL_PMAX];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    FL_UNROLL
    for (int h = 0; h < 2 * P; h++) {
        const int64_t c = o0 + h * 8;
        const int64_t nv = (out - c) < 8 ? (out - c) : 8; /* may be <= 0 */
        msk[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nv < 0 ? 0 : nv)), lane);
    }
    FL_UNROLL
    for (int r = 0; r < R; r++)
        FL_UNROLL
        for (int h = 0; h < 2 * P; h++)
            acc[r][h] = first ? _mm256_setzero_ps()
                              : _mm256_maskload_ps(y + r * ldy + o0 + h * 8, msk[h]);
    for (int64_t k = 0; k < kn; k++) {
        __m256 w[2 * FL_PMAX];
        FL_UNROLL
        for (int p = 0; p < P; p++) {
            w[2 * p] = _mm256_loadu_ps(wp + p * ps + k * FL_PW);
            w[2 * p + 1] = _mm256_loadu_ps(wp + p * ps + k * FL_PW + 8);
            FL_PREFETCH(P, wp + p * ps + (k + FL_PFD) * FL_PW);
        }
        FL_UNROLL
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            FL_UNROLL
            for (int h = 0; h < 2 * P; h++)
                acc[r][h] = _mm256_fmadd_ps(w[h], xb, acc[r][h]);
        }
    }
    FL_UNROLL
    for (int h = 0; h < 2 * P; h++) {
        const int64_t c = o0 + h * 8;
        const int addb = last && bias;
        const __m256 b = addb ? _mm256_maskload_ps(bias + c, msk[h]) : _mm256_setzero_ps();
        FL_UNROLL
        for (int r = 0; r < R; r++) {
            __m256 v = acc[r][h];
            if (addb)
                v = _mm256_add_ps(v, b);
            _mm256_maskstore_ps(y + r * ldy + c, msk[h], v);
        }
    }
}

#else /* portable C; fmaf keeps the same fused, in-order summation contract */

FL_INLINE void fl_kern_body(const int R, const int P, const float *x,
                            int64_t ldx, const float *wp, int64_t ps,
                            int64_t kn, float *y, int64_t ldy,
                            const float *bias, int64_t o0, int64_t out,
                            int first, int last)
{
    for (int r = 0; r < R; r++) {
        for (int p = 0; p < P; p++) {
            const int64_t c = o0 + p * FL_PW;
            const int64_t nv = (out - c) < FL_PW ? (out - c) : FL_PW;
            float *yr = y + r * ldy + c;
            float acc[FL_PW];
            for (int j = 0; j < FL_PW; j++)
                acc[j] = (!first && j < nv) ? yr[j] : 0.0f;
            const float *w = wp + p * ps;
            const float *xr = x + r * ldx;
            for (int64_t k = 0; k < kn; k++)
                for (int j = 0; j < FL_PW; j++)
                    acc[j] = fmaf(w[k * FL_PW + j], xr[k], acc[j]);
            for (int64_t j = 0; j < nv; j++)
                yr[j] = (last && bias) ? acc[j] + bias[c + j] : acc[j];
        }
    }
}

#endif

#define FL_K(R, P)                                                            \
    static void fl_kern_##R##_##P(                                            \
        const float *x, int64_t ldx, const float *wp, int64_t ps, int64_t kn, \
        float *y, int64_t ldy, const float *bias, int64_t o0, int64_t out,    \
        int first, int last)                                                  \
    {                                                                         \
        fl_kern_body(R, P, x, ldx, wp, ps, kn, y, ldy, bias, o0, out, first,  \
                     last);                                                   \
    }
#define FL_K4(R) FL_K(R, 1) FL_K(R, 2) FL_K(R, 3) FL_K(R, 4)
FL_K4(1) FL_K4(2) FL_K4(3) FL_K4(4) FL_K4(5) FL_K4(6) FL_K4(7) FL_K4(8)

#define FL_T(R) {fl_kern_##R##_1, fl_kern_##R##_2, fl_kern_##R##_3, fl_kern_##R##_4}
static const fl_kern_t fl_table[FL_RMAX + 1][FL_PMAX] = {
    {0, 0, 0, 0}, FL_T(1), FL_T(2), FL_T(3), FL_T(4),
    FL_T(5),      FL_T(6), FL_T(7), FL_T(8)};

/* register blocking: at most fl_rmax() rows per block, and for a block of R
 * rows fl_panels_for_rows(R) panels, so that R*P accumulators + P weight
 * vectors + 1 broadcast fit the register file (32 zmm / 16 ymm). */
static int fl_rmax(void)
{
#if defined(__AVX512F__)
    return 8;
#elif defined(__AVX2__) && defined(__FMA__)
    return 6;
#else
    return 4;
#endif
}

static int fl_panels_for_rows(int R)
{
#if defined(__AVX512F__)
    return R <= 6 ? 4 : 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return R == 1 ? 3 : (R == 2 ? 2 : 1);
#else
    (void)R;
    return 1;
#endif
}

/* ------------------------------------------------------------------------ */
/* driver                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct {
    const float *x;
    int64_t ldx, N, in;
    const float *wp;
    const float *bias;
    int64_t out;
    float *y;
    int64_t ldy;
    int64_t nblk, rbase, rextra; /* balanced row blocks */
    int pg;                      /* panels per register block */
    int64_t kb;                  /* k block length */
    int64_t np, chunk;           /* panels, panels per work chunk */
} fl_job_t;

/* panels [pa, pb) for all N rows */
static void fl_run_panels(const fl_job_t *j, int64_t pa, int64_t pb)
{
    const int64_t in = j->in, ps = in * FL_PW;
    for (int64_t p = pa; p < pb; p += j->pg) {
        const int pg = (int)((pb - p) < j->pg ? (pb - p) : j->pg);
        const float *wpp = j->wp + p * ps;
        for (int64_t k0 = 0; k0 < in; k0 += j->kb) {
            const int64_t kn = (in - k0) < j->kb ? (in - k0) : j->kb;
            const int first = k0 == 0, last = k0 + kn >= in;
            int64_t r0 = 0;
            for (int64_t b = 0; b < j->nblk; b++) {
                const int R = (int)(j->rbase + (b < j->rextra ? 1 : 0));
                fl_table[R][pg - 1](j->x + r0 * j->ldx + k0, j->ldx,
                                    wpp + k0 * FL_PW, ps, kn, j->y + r0 * j->ldy,
                                    j->ldy, j->bias, p * FL_PW, j->out, first,
                                    last);
                r0 += R;
            }
        }
    }
}

static void fl_forward_chunk(const void *vctx, int64_t c)
{
    const fl_job_t *j = (const fl_job_t *)vctx;
    const int64_t pa = c * j->chunk;
    const int64_t pb = (pa + j->chunk) < j->np ? (pa + j->chunk) : j->np;
    fl_run_panels(j, pa, pb);
}

/*
 * y[N][out] (row stride ldy) = x[N][in] (row stride ldx) @ W.T + bias,
 * W given packed (fl_pack).  nthreads: upper bound on threads (the
 * caller passes torch.get_num_threads()); small problems use fewer.
 * Work is handed out in chunks of whole register blocks (claimed
 * dynamically, so a thread that shares its core with another process does
 * less of it);
 * which thread computes a column never changes how it is computed.
 */
void fl_forward(const float *x, int64_t ldx, int64_t N, int64_t in,
                const float *wp, const float *bias, int64_t out, float *y,
                int64_t ldy, int nthreads)
{
    if (N <= 0 || out <= 0)
        return;
    if (in <= 0) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t o = 0; o < out; o++)
                y[n * ldy + o] = bias ? bias[o] : 0.0f;
        return;
    }
    const int64_t np = (out + FL_PW - 1) / FL_PW;
    fl_job_t j;
    j.x = x; j.ldx = ldx; j.N = N; j.in = in; j.wp = wp; j.bias = bias;
    j.out = out; j.y = y; j.ldy = ldy; j.np = np; j.chunk = np;
    const int rmax = fl_rmax();
    j.nblk = (N + rmax - 1) / rmax;
    j.rbase = N / j.nblk;
    j.rextra = N % j.nblk;
    j.pg = fl_panels_for_rows((int)(j.rbase + (j.rextra ? 1 : 0)));
    /* one row block: stream each panel once, no k blocking needed.  Several
     * row blocks: k blocks small enough that the P panels' slice stays in L1/L2
     * while every row block uses it. */
    j.kb = j.nblk == 1 ? in : FL_KB;

    /* threads: at least ~256 KiB of weight each */
    const int64_t wbytes = np * in * FL_PW * 4;
    int64_t nt = nthreads < 1 ? 1 : nthreads;
    if (nt > wbytes / 262144)
        nt = wbytes / 262144;
    const int64_t ngroups = (np + j.pg - 1) / j.pg;
    if (nt > ngroups)
        nt = ngroups;
    if (nt <= 1) {
        fl_run_panels(&j, 0, np);
        return;
    }
    /* ~8 chunks per thread, each a whole number of register blocks */
    int64_t cg = (ngroups + nt * 8 - 1) / (nt * 8);
    if (cg < 1)
        cg = 1;
    j.chunk = cg * j.pg;
    fl_parallel(fl_forward_chunk, &j, (np + j.chunk - 1) / j.chunk, (int)nt);
}
