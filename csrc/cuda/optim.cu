/* cuda/optim.cu: the fused multi-tensor Adam/AdamW (fp32, bf16 and 8-bit block-wise state) and SGD steps on a CUDA
 * device (kernels.h), in CUDA C: the CPU kernels' element math (adam_math.h, sgd.h, qmap.h, fpconv.h) per thread,
 * compiled with -fmad=false, so the bits are the CPU's.
 *   dense kernel (fp32 and bf16 state): block b of a launch steps chunk b - first[t] (ACC_CU_CHUNK elements) of its
 *     tensor t; tensors whose arrays are aligned go 4 elements per access. bf16 state is written with the
 *     stochastic rounding of the element's logical index (qmap.h acc_sr_hash), so slicing and the grid change no bit.
 *   8-bit kernel: one warp per 256-element quantisation block, ACC_CU_QBLOCKS per CUDA block; a lane holds 8
 *     consecutive elements (8 lane + j; one 8-byte access per code array): dequantise, update, then the block's
 *     new absmax (a warp max of the bit patterns, as the CPU compares them) and the requantised codes.
 * Host mode: each tensor's scalars (lr/bc1 ...) and rounding seed are computed on the host by the CPU's own
 * function and travel in the launch. Device mode (capturable steps): each thread derives them from the step count
 * (and lr) in device memory, and a last kernel advances the counts: a CUDA graph replays the next step.
 * The launch plans and per-thread functions are ACC_HD; acc_cuda_emulate_adam / _sgd run them on the CPU.
 * Not for: Python, state allocation, the non-finite pre-check (ops.cu). */
#include <math.h>
#include <stdlib.h>

#include "cuda/cuda_common.h"
#include "optim/adam_check.h"
#include "optim/qmap.h"
#include "optim/sgd.h"

typedef struct {
    float *param, *vmax, *absm, *absv, *step_dev;
    const void *grad;
    void *m, *v, *lp;
    uint64_t n, offset, salt;
    acc_adam_scalars c;         /* host mode */
    uint32_t seed;              /* host mode */
    int gdt, lpdt, sdt, vec4;
} adam_item;

typedef struct {
    mt_plan plan;
    adam_item it[ACC_CU_MT];
    acc_adam_config cfg;        /* device mode: the scalars are derived on the device */
    acc_qmap qs, qu;            /* 8-bit: the signed (exp_avg) and unsigned (exp_avg_sq) maps */
    const float *lr_dev, *found_inf;
    int device_mode;
} adam_launch;

/* ---- per-thread work (host and device) ------------------------------------------------------------------ */

static inline ACC_HD void adam_scalars(const adam_launch *L, const adam_item *t, acc_adam_scalars *c,
                                       uint32_t *seed) {
    if (!L->device_mode) {
        *c = t->c;
        *seed = t->seed;
        return;
    }
    acc_adam_config cfg = L->cfg;
    double step = (double)*t->step_dev + 1.0; /* the CPU binding's: the stored count, plus one */
    if (L->lr_dev) cfg.lr = (double)*L->lr_dev;
    acc_adam_scalars_for(&cfg, step, c);
    *seed = acc_sr_seed(step, t->salt);
}

static inline ACC_HD void adam32_elem(const adam_item *t, const acc_adam_scalars *c, uint64_t i) {
    float *M = (float *)t->m, *S = (float *)t->v;
    float p = t->param[i], m = M[i], v = S[i], mx = t->vmax ? t->vmax[i] : 0.0f;
    acc_adam_update1(c, acc_load_elem(t->grad, (acc_dtype)t->gdt, i), &p, &m, &v, t->vmax ? &mx : NULL);
    t->param[i] = p, M[i] = m, S[i] = v;
    if (t->vmax) t->vmax[i] = mx;
    if (t->lp) acc_store_lp(t->lp, (acc_dtype)t->lpdt, i, p);
}

static inline ACC_HD void adam32_vec4(const adam_item *t, const acc_adam_scalars *c, uint64_t q) {
    float g[4], p[4], m[4], v[4], mx[4];
    ld4f(t->grad, (acc_dtype)t->gdt, q, g);
    ld4f(t->param, ACC_F32, q, p);
    ld4f(t->m, ACC_F32, q, m);
    ld4f(t->v, ACC_F32, q, v);
    if (t->vmax) ld4f(t->vmax, ACC_F32, q, mx);
    for (int j = 0; j < 4; j++) acc_adam_update1(c, g[j], &p[j], &m[j], &v[j], t->vmax ? &mx[j] : NULL);
    st4f32(t->param, q, p);
    st4f32((float *)t->m, q, m);
    st4f32((float *)t->v, q, v);
    if (t->vmax) st4f32(t->vmax, q, mx);
    if (t->lp) st4lp(t->lp, (acc_dtype)t->lpdt, q, p);
}

/* bf16 state: adam_lowbit_body.inc's scalar path (widen, update, stochastic rounding by the logical index) */
static inline ACC_HD void adam16_elem(const adam_item *t, const acc_adam_scalars *c, uint32_t seed, uint64_t i) {
    uint16_t *M = (uint16_t *)t->m, *S = (uint16_t *)t->v;
    float p = t->param[i], m = acc_bf16_to_f32(M[i]), v = acc_bf16_to_f32(S[i]);
    acc_adam_update1(c, acc_load_elem(t->grad, (acc_dtype)t->gdt, i), &p, &m, &v, NULL);
    t->param[i] = p;
    if (t->lp) acc_store_lp(t->lp, (acc_dtype)t->lpdt, i, p);
    uint32_t h = acc_sr_hash((uint32_t)(t->offset + i), seed);
    M[i] = acc_f32_to_bf16_sr(m, h);
    S[i] = acc_f32_to_bf16_sr(v, h >> 16);
}

/* bf16 state, 4 consecutive elements 4q .. 4q+3 (aligned arrays, t->vec4): every load before the first store, one
 * access per array; the same bits as adam16_elem */
static inline ACC_HD void adam16_vec4(const adam_item *t, const acc_adam_scalars *c, uint32_t seed, uint64_t q) {
    float g[4], p[4], m[4], v[4];
    ld4f(t->grad, (acc_dtype)t->gdt, q, g);
    ld4f(t->param, ACC_F32, q, p);
    ld4f(t->m, ACC_BF16, q, m);
    ld4f(t->v, ACC_BF16, q, v);
    uint16_t um[4], uv[4];
    for (int j = 0; j < 4; j++) {
        acc_adam_update1(c, g[j], &p[j], &m[j], &v[j], NULL);
        const uint32_t h = acc_sr_hash((uint32_t)(t->offset + 4 * q + (uint64_t)j), seed);
        um[j] = acc_f32_to_bf16_sr(m[j], h);
        uv[j] = acc_f32_to_bf16_sr(v[j], h >> 16);
    }
    st4f32(t->param, q, p);
    if (t->lp) st4lp(t->lp, (acc_dtype)t->lpdt, q, p);
    st4u16(t->m, q, um);
    st4u16(t->v, q, uv);
}

/* thread tid of nthr in chunk `blk` of tensor t (dense kernel) */
static inline ACC_HD void adam_dense_thread(const adam_launch *L, const adam_item *t, uint32_t blk, uint32_t tid,
                                            uint32_t nthr) {
    acc_adam_scalars c;
    uint32_t seed;
    adam_scalars(L, t, &c, &seed);
    const uint64_t lo = (uint64_t)blk * ACC_CU_CHUNK, hi = cu_min64(lo + ACC_CU_CHUNK, t->n);
    const int bf16 = t->sdt == ACC_BF16;
    uint64_t i0 = lo;
    if (t->vec4) { /* lo is a multiple of 4; the groups end where the tensor's last whole group does */
        const uint64_t hv = hi & ~(uint64_t)3;
        for (uint64_t q = lo / 4 + tid; q < hv / 4; q += nthr) {
            if (bf16) adam16_vec4(t, &c, seed, q);
            else adam32_vec4(t, &c, q);
        }
        i0 = hv;
    }
    for (uint64_t i = i0 + tid; i < hi; i += nthr) {
        if (bf16) adam16_elem(t, &c, seed, i);
        else adam32_elem(t, &c, i);
    }
}

/* 8-bit state, pass 1 of lane `lane` in quantisation block qb: its 8 consecutive elements qb*256 + 8 lane + j
 * (one access per array where the block is whole and the arrays aligned, t->vec4), every load before the first
 * store; dequantised and updated (param written), the new m and v kept for pass 2, their largest |bits| returned.
 * Which lane holds which element changes no bit: the block's absmax is a maximum. */
static inline ACC_HD void q8_update(const acc_qmap *qs, const acc_qmap *qu, const adam_item *t,
                                    const acc_adam_scalars *c, uint64_t qb, int lane, float m[8], float v[8],
                                    uint32_t *hm, uint32_t *hv) {
    const uint8_t *QM = (const uint8_t *)t->m, *QV = (const uint8_t *)t->v;
    const float am = t->absm[qb], av = t->absv[qb];
    const uint64_t i0 = qb * ACC_QBLOCK + 8u * (uint64_t)lane;
    const int k = i0 >= t->n ? 0 : (int)cu_min64(8, t->n - i0);
    float p[8], g[8];
    uint64_t cm = 0, cv = 0;
    if (t->vec4 && k == 8) {
        ld4f(t->param, ACC_F32, i0 / 4, p);
        ld4f(t->param, ACC_F32, i0 / 4 + 1, p + 4);
        ld4f(t->grad, (acc_dtype)t->gdt, i0 / 4, g);
        ld4f(t->grad, (acc_dtype)t->gdt, i0 / 4 + 1, g + 4);
        cm = *(const unsigned long long *)(QM + i0);
        cv = *(const unsigned long long *)(QV + i0);
    } else {
        for (int j = 0; j < k; j++) {
            p[j] = t->param[i0 + j];
            g[j] = acc_load_elem(t->grad, (acc_dtype)t->gdt, i0 + j);
            cm |= (uint64_t)QM[i0 + j] << (8 * j);
            cv |= (uint64_t)QV[i0 + j] << (8 * j);
        }
    }
    uint32_t mm = 0, mv = 0;
    for (int j = 0; j < 8; j++) {
        m[j] = v[j] = 0.0f;
        if (j >= k) continue;
        m[j] = acc_q_decode(qs, 1, (uint8_t)(cm >> (8 * j)), am);
        v[j] = acc_q_decode(qu, 0, (uint8_t)(cv >> (8 * j)), av);
        acc_adam_update1(c, g[j], &p[j], &m[j], &v[j], NULL);
        const uint32_t um = acc_f2u(m[j]) & 0x7fffffffu, uv = acc_f2u(v[j]) & 0x7fffffffu;
        mm = um > mm ? um : mm;
        mv = uv > mv ? uv : mv;
    }
    if (t->vec4 && k == 8) {
        st4f32(t->param, i0 / 4, p);
        st4f32(t->param, i0 / 4 + 1, p + 4);
        if (t->lp) st4lp(t->lp, (acc_dtype)t->lpdt, i0 / 4, p), st4lp(t->lp, (acc_dtype)t->lpdt, i0 / 4 + 1, p + 4);
    } else {
        for (int j = 0; j < k; j++) {
            t->param[i0 + j] = p[j];
            if (t->lp) acc_store_lp(t->lp, (acc_dtype)t->lpdt, i0 + j, p[j]);
        }
    }
    *hm = mm, *hv = mv;
}

/* pass 2: the lane's elements requantised with the block's new scales (bit patterns hm, hv), one store per array
 * where pass 1 had one load */
static inline ACC_HD void q8_encode(const acc_qmap *qs, const acc_qmap *qu, const adam_item *t, uint64_t qb,
                                    int lane, const float m[8], const float v[8], uint32_t hm, uint32_t hv) {
    uint8_t *QM = (uint8_t *)t->m, *QV = (uint8_t *)t->v;
    const float im = acc_q_inverse(acc_u2f(hm)), iv = acc_q_inverse(acc_u2f(hv));
    const uint64_t i0 = qb * ACC_QBLOCK + 8u * (uint64_t)lane;
    const int k = i0 >= t->n ? 0 : (int)cu_min64(8, t->n - i0);
    uint64_t cm = 0, cv = 0;
    for (int j = 0; j < k; j++) {
        cm |= (uint64_t)acc_q_encode(qs, 1, m[j], im) << (8 * j);
        cv |= (uint64_t)acc_q_encode(qu, 0, v[j], iv) << (8 * j);
    }
    if (t->vec4 && k == 8) {
        *(unsigned long long *)(QM + i0) = cm;
        *(unsigned long long *)(QV + i0) = cv;
        return;
    }
    for (int j = 0; j < k; j++) QM[i0 + j] = (uint8_t)(cm >> (8 * j)), QV[i0 + j] = (uint8_t)(cv >> (8 * j));
}

static inline ACC_HD int skipped(const float *found_inf) { return found_inf && *found_inf != 0.0f; }

/* ---- kernels ----------------------------------------------------------------------------------------------- */

__global__ void __launch_bounds__(ACC_CU_THREADS) k_adam_dense(const adam_launch L) {
    if (skipped(L.found_inf)) return;
    const int t = mt_find(&L.plan, blockIdx.x);
    adam_dense_thread(&L, &L.it[t], blockIdx.x - L.plan.first[t], threadIdx.x, blockDim.x);
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_adam_q8(const adam_launch L) {
    __shared__ acc_qmap maps[2];
    if (skipped(L.found_inf)) return;
    if (threadIdx.x == 0) maps[0] = L.qs, maps[1] = L.qu;
    __syncthreads();
    const int t = mt_find(&L.plan, blockIdx.x);
    const adam_item *it = &L.it[t];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint64_t qb = (uint64_t)(blockIdx.x - L.plan.first[t]) * ACC_CU_QBLOCKS + (uint64_t)warp;
    if (qb * ACC_QBLOCK >= it->n) return; /* the whole warp: no later shuffle misses a lane */
    acc_adam_scalars c;
    uint32_t seed, hm, hv;
    adam_scalars(&L, it, &c, &seed);
    float m[8], v[8];
    q8_update(&maps[0], &maps[1], it, &c, qb, lane, m, v, &hm, &hv);
    for (int off = 16; off; off >>= 1) { /* every lane ends with the warp's maxima (unsigned compare) */
        hm = max(hm, __shfl_xor_sync(0xffffffffu, hm, off));
        hv = max(hv, __shfl_xor_sync(0xffffffffu, hv, off));
    }
    if (lane == 0) it->absm[qb] = acc_u2f(hm), it->absv[qb] = acc_u2f(hv); /* every lane read them in pass 1 */
    q8_encode(&maps[0], &maps[1], it, qb, lane, m, v, hm, hv);
}

typedef struct {
    float *steps[ACC_CU_MT];
    int k;
    const float *found_inf;
} incr_launch;

__global__ void k_step_incr(const incr_launch L) {
    if (!skipped(L.found_inf) && (int)threadIdx.x < L.k) *L.steps[threadIdx.x] += 1.0f;
}

/* ---- planning (host) ---------------------------------------------------------------------------------------- */

/* runs one planned launch: kind 0 dense, 1 8-bit; on the device or emulated */
typedef acc_status (*adam_runner)(const adam_launch *L, int kind, void *ctx);

static acc_status adam_check(const acc_adam_config *cfg, size_t k, const acc_cuda_adam_tensor *x, int device_mode) {
    const acc_adam_shape shape = ACC_ADAM_SHAPE_INIT(x);
    acc_status st = acc_adam_check_shape(cfg, k, &shape);
    if (st) return st;
    if ((x->step_dev != NULL) != device_mode) {
        acc_set_error("tensor %zu: step counts must be all on the device or all on the host", k);
        return ACC_ERR_ARG;
    }
    if (!device_mode && !(x->step >= 1)) {
        acc_set_error("tensor %zu: step must be >= 1 (got %g)", k, x->step);
        return ACC_ERR_ARG;
    }
    return ACC_OK;
}

static void adam_item_of(const acc_adam_config *cfg, const acc_cuda_adam_tensor *x, int device_mode, adam_item *t) {
    memset(t, 0, sizeof *t);
    t->param = x->param, t->vmax = cfg->amsgrad ? x->max_exp_avg_sq : NULL, t->absm = x->exp_avg_absmax;
    t->absv = x->exp_avg_sq_absmax, t->step_dev = x->step_dev, t->grad = x->grad, t->m = x->exp_avg;
    t->v = x->exp_avg_sq, t->lp = x->lp_out, t->n = x->n, t->offset = x->offset, t->salt = x->salt;
    t->gdt = x->grad_dtype, t->lpdt = x->lp_dtype, t->sdt = x->state_dtype;
    if (!device_mode) {
        acc_adam_scalars_for(cfg, x->step, &t->c);
        t->seed = acc_sr_seed(x->step, x->salt);
    }
    /* vector accesses: 4 elements (fp32 and bf16 state), or 8 per lane (8-bit: two groups of 4, 8 code bytes) */
    const unsigned sb = x->state_dtype == ACC_F32 ? 16 : 8;
    t->vec4 = cu_aligned(x->param, 16) && cu_aligned(x->exp_avg, sb) && cu_aligned(x->exp_avg_sq, sb) &&
              cu_aligned(t->vmax, 16) && cu_aligned(x->grad, x->grad_dtype == ACC_F32 ? 16 : 8) &&
              cu_aligned(x->lp_out, 8);
}

static uint32_t adam_blocks(const acc_cuda_adam_tensor *x) {
    if (x->state_dtype == ACC_U8) {
        const uint64_t nq = (x->n + ACC_QBLOCK - 1) / ACC_QBLOCK;
        return (uint32_t)((nq + ACC_CU_QBLOCKS - 1) / ACC_CU_QBLOCKS);
    }
    return (uint32_t)((x->n + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
}

static acc_status adam_plan(const acc_adam_config *cfg, const acc_cuda_adam_tensor *ts, size_t nt,
                            const float *lr_dev, const float *found_inf, adam_runner run, void *ctx) {
    const int device_mode = nt && ts[0].step_dev != NULL;
    for (size_t k = 0; k < nt; k++) {
        acc_status st = adam_check(cfg, k, &ts[k], device_mode);
        if (st) return st;
        if (ts[k].n > ((uint64_t)ACC_CU_MAX_GRID * ACC_CU_CHUNK)) {
            acc_set_error("tensor %zu: %llu elements is too many for one launch", k, (unsigned long long)ts[k].n);
            return ACC_ERR_ARG;
        }
    }
    adam_launch *Lp = (adam_launch *)calloc(1, sizeof(adam_launch)); /* ~6 KB, copied into the launch */
    if (!Lp) return ACC_ERR_NOMEM;
    Lp->cfg = *cfg, Lp->lr_dev = lr_dev, Lp->found_inf = found_inf, Lp->device_mode = device_mode;
    if (lr_dev) Lp->cfg.lr_is_f32_tensor = 1;
    acc_qmap_build(&Lp->qs, 7);
    acc_qmap_build(&Lp->qu, 8);
    acc_status st = ACC_OK;
    for (int kind = 0; kind < 2 && st == ACC_OK; kind++) {
        Lp->plan.k = 0;
        uint32_t blocks = 0;
        for (size_t k = 0; k <= nt && st == ACC_OK; k++) {
            const int last = k == nt;
            const uint32_t nb = last ? 0 : adam_blocks(&ts[k]);
            if (!last && (ts[k].state_dtype == ACC_U8) != kind) continue;
            if (Lp->plan.k && (last || Lp->plan.k == ACC_CU_MT || (uint64_t)blocks + nb > ACC_CU_MAX_GRID)) {
                Lp->plan.first[Lp->plan.k] = blocks;
                if (blocks) st = run(Lp, kind, ctx);
                Lp->plan.k = 0, blocks = 0;
            }
            if (last) break;
            Lp->plan.first[Lp->plan.k] = blocks;
            adam_item_of(cfg, &ts[k], device_mode, &Lp->it[Lp->plan.k++]);
            blocks += nb;
        }
    }
    free(Lp);
    return st;
}

/* ---- on the device ------------------------------------------------------------------------------------------ */

static acc_status adam_run_device(const adam_launch *L, int kind, void *stream) {
    const uint32_t grid = L->plan.first[L->plan.k];
    if (kind == 0) k_adam_dense<<<grid, ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(*L);
    else k_adam_q8<<<grid, 32 * ACC_CU_QBLOCKS, 0, (cudaStream_t)stream>>>(*L);
    acc_status st = cu_check("adam_step");
    if (st || !L->device_mode) return st;
    incr_launch I;
    memset(&I, 0, sizeof I);
    I.k = L->plan.k, I.found_inf = L->found_inf;
    for (int t = 0; t < L->plan.k; t++) I.steps[t] = L->it[t].step_dev;
    k_step_incr<<<1, ACC_CU_MT, 0, (cudaStream_t)stream>>>(I);
    return cu_check("adam_step (step counts)");
}

static acc_status adam_runner_device(const adam_launch *L, int kind, void *ctx) { return adam_run_device(L, kind, ctx); }

extern "C" acc_status acc_cuda_adam_step(const acc_adam_config *cfg, const acc_cuda_adam_tensor *ts, size_t nt,
                                         const float *lr_dev, const float *found_inf, void *stream) {
    return adam_plan(cfg, ts, nt, lr_dev, found_inf, adam_runner_device, stream);
}

/* ---- emulated on the CPU: every block, warp and thread of the plan in turn ------------------------------------- */

static acc_status adam_runner_emulated(const adam_launch *L, int kind, void *ctx) {
    if (skipped(L->found_inf)) return ACC_OK;
    const uint32_t grid = L->plan.first[L->plan.k];
    for (uint32_t b = 0; b < grid; b++) {
        const int t = mt_find(&L->plan, b);
        const adam_item *it = &L->it[t];
        if (kind == 0) {
            for (uint32_t tid = 0; tid < ACC_CU_THREADS; tid++)
                adam_dense_thread(L, it, b - L->plan.first[t], tid, ACC_CU_THREADS);
            continue;
        }
        for (int w = 0; w < ACC_CU_QBLOCKS; w++) {
            const uint64_t qb = (uint64_t)(b - L->plan.first[t]) * ACC_CU_QBLOCKS + (uint64_t)w;
            if (qb * ACC_QBLOCK >= it->n) break;
            acc_adam_scalars c;
            uint32_t seed, hm = 0, hv = 0, lm[32], lv[32];
            float m[32][8], v[32][8];
            adam_scalars(L, it, &c, &seed);
            for (int lane = 0; lane < 32; lane++) {
                q8_update(&L->qs, &L->qu, it, &c, qb, lane, m[lane], v[lane], &lm[lane], &lv[lane]);
                hm = lm[lane] > hm ? lm[lane] : hm;
                hv = lv[lane] > hv ? lv[lane] : hv;
            }
            it->absm[qb] = acc_u2f(hm), it->absv[qb] = acc_u2f(hv);
            for (int lane = 0; lane < 32; lane++) q8_encode(&L->qs, &L->qu, it, qb, lane, m[lane], v[lane], hm, hv);
        }
    }
    if (L->device_mode)
        for (int t = 0; t < L->plan.k; t++) *L->it[t].step_dev += 1.0f;
    return ACC_OK;
}

extern "C" acc_status acc_cuda_emulate_adam(const acc_adam_config *cfg, const acc_cuda_adam_tensor *ts, size_t nt,
                                            const float *lr, const float *found_inf) {
    return adam_plan(cfg, ts, nt, lr, found_inf, adam_runner_emulated, NULL);
}

/* ---- SGD ------------------------------------------------------------------------------------------------------ */

typedef struct {
    float *param, *buf;
    const void *grad;
    void *lp;
    uint64_t n;
    int init, gdt, lpdt;
} sgd_item;

typedef struct {
    mt_plan plan;
    sgd_item it[ACC_CU_MT];
    const float *found_inf;
    int scaled, maximize, has_wd, nesterov;
    float gs, wd, mom, one_m_damp, neg_lr;
} sgd_launch;

static inline ACC_HD void sgd_thread(const sgd_launch *L, const sgd_item *t, uint32_t blk, uint32_t tid,
                                     uint32_t nthr) {
    const uint64_t lo = (uint64_t)blk * ACC_CU_CHUNK, hi = cu_min64(lo + ACC_CU_CHUNK, t->n);
    for (uint64_t i = lo + tid; i < hi; i += nthr) {
        float p = t->param[i];
        acc_sgd_update1(acc_load_elem(t->grad, (acc_dtype)t->gdt, i), &p, t->buf ? &t->buf[i] : NULL, L->scaled,
                        L->gs, L->maximize, L->has_wd, L->wd, t->init, L->mom, L->one_m_damp, L->nesterov, L->neg_lr);
        t->param[i] = p;
        if (t->lp) acc_store_lp(t->lp, (acc_dtype)t->lpdt, i, p);
    }
}

__global__ void __launch_bounds__(ACC_CU_THREADS) k_sgd(const sgd_launch L) {
    if (skipped(L.found_inf)) return;
    const int t = mt_find(&L.plan, blockIdx.x);
    sgd_thread(&L, &L.it[t], blockIdx.x - L.plan.first[t], threadIdx.x, blockDim.x);
}

typedef acc_status (*sgd_runner)(const sgd_launch *L, void *ctx);

static acc_status sgd_plan(const acc_cuda_sgd_config *cfg, const acc_cuda_sgd_tensor *ts, size_t nt,
                           const float *found_inf, sgd_runner run, void *ctx) {
    for (size_t k = 0; k < nt; k++) {
        const acc_cuda_sgd_tensor *x = &ts[k];
        if (x->grad_dtype != ACC_F32 && x->grad_dtype != ACC_BF16 && x->grad_dtype != ACC_F16) {
            acc_set_error("tensor %zu: grad dtype %s not supported", k, acc_dtype_name(x->grad_dtype));
            return ACC_ERR_DTYPE;
        }
        if ((x->lp_out && x->lp_dtype != ACC_BF16 && x->lp_dtype != ACC_F16) ||
            (cfg->momentum != 0.0 && !x->momentum_buf) || (x->n && (!x->param || !x->grad))) {
            acc_set_error("tensor %zu: a momentum buffer (momentum != 0), param and grad, and a bfloat16/float16 "
                          "copy are required as given", k);
            return ACC_ERR_ARG;
        }
    }
    sgd_launch *L = (sgd_launch *)calloc(1, sizeof(sgd_launch));
    if (!L) return ACC_ERR_NOMEM;
    L->found_inf = found_inf, L->scaled = cfg->grad_scale != 1.0, L->maximize = cfg->maximize;
    L->has_wd = cfg->weight_decay != 0.0, L->nesterov = cfg->nesterov, L->gs = (float)cfg->grad_scale;
    L->wd = (float)cfg->weight_decay, L->mom = (float)cfg->momentum, L->one_m_damp = (float)(1.0 - cfg->dampening);
    L->neg_lr = (float)(-cfg->lr);
    acc_status st = ACC_OK;
    uint32_t blocks = 0;
    for (size_t k = 0; k <= nt && st == ACC_OK; k++) {
        const int last = k == nt;
        const uint32_t nb = last ? 0 : (uint32_t)((ts[k].n + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
        if (L->plan.k && (last || L->plan.k == ACC_CU_MT || (uint64_t)blocks + nb > ACC_CU_MAX_GRID)) {
            L->plan.first[L->plan.k] = blocks;
            if (blocks) st = run(L, ctx);
            L->plan.k = 0, blocks = 0;
        }
        if (last) break;
        sgd_item *t = &L->it[L->plan.k];
        L->plan.first[L->plan.k++] = blocks;
        t->param = ts[k].param, t->buf = cfg->momentum != 0.0 ? ts[k].momentum_buf : NULL, t->grad = ts[k].grad;
        t->lp = ts[k].lp_out, t->n = ts[k].n, t->init = ts[k].init_buf, t->gdt = ts[k].grad_dtype;
        t->lpdt = ts[k].lp_dtype;
        blocks += nb;
    }
    free(L);
    return st;
}

static acc_status sgd_runner_device(const sgd_launch *L, void *stream) {
    k_sgd<<<L->plan.first[L->plan.k], ACC_CU_THREADS, 0, (cudaStream_t)stream>>>(*L);
    return cu_check("sgd_step");
}

static acc_status sgd_runner_emulated(const sgd_launch *L, void *ctx) {
    if (skipped(L->found_inf)) return ACC_OK;
    for (uint32_t b = 0; b < L->plan.first[L->plan.k]; b++) {
        const int t = mt_find(&L->plan, b);
        for (uint32_t tid = 0; tid < ACC_CU_THREADS; tid++)
            sgd_thread(L, &L->it[t], b - L->plan.first[t], tid, ACC_CU_THREADS);
    }
    return ACC_OK;
}

extern "C" acc_status acc_cuda_sgd_step(const acc_cuda_sgd_config *cfg, const acc_cuda_sgd_tensor *ts, size_t nt,
                                        const float *found_inf, void *stream) {
    return sgd_plan(cfg, ts, nt, found_inf, sgd_runner_device, stream);
}

extern "C" acc_status acc_cuda_emulate_sgd(const acc_cuda_sgd_config *cfg, const acc_cuda_sgd_tensor *ts, size_t nt,
                                           const float *found_inf) {
    return sgd_plan(cfg, ts, nt, found_inf, sgd_runner_emulated, NULL);
}
