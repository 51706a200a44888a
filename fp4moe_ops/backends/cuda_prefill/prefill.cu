// Prefill GEMMs of the NVFP4 experts in CUDA for Hopper (sm_90a), issue 17: an experiment against
// the Gluon kernels of ../triton_moe/prefill_rs.py, on the same inputs and data layouts.
//
// The structure is prefill_rs.py's (weights as wgmma's register operand, decoded by the warps that
// issue the MMA; activations from shared memory), without what Gluon 3.6 imposes: a warpgroup of
// its own issues every TMA copy (one thread, no barrier of the partition around each copy), the
// consumers take more registers (setmaxnreg), and each 16-wide K chunk is decoded while the
// previous chunks' wgmma run (wgmma.wait_group 3 instead of a wait per 64-wide step).
//
// One program: weight tile t (GEMM1: gate rows 128t.. and the same up rows; GEMM2: rows 256t..)
// x row block b (up to BM tokens of one expert). Warpgroup 0 loads, warpgroups 1 and 2 each own
// 128 weight rows as two m64 blocks (GEMM1: 64 gate rows and the same 64 up rows).
//
// Layouts (../triton_moe/layout.py): the weights are paired words, int32 [E, R/2, K/4] (R rows
// per expert; pair row p holds rows 16(p/8) + p%8 and + 8, word u their 2-byte units u); K runs in
// fragment order (chunk 64) in the activations, so a thread's four words of a 64-wide step are
// contiguous and each is exactly the four bf16x2 A registers of one k16 chunk. Scales: E4M3 bytes
// [E, R, K/16]; decoded values carry 2^-22, folded into the global scale in the epilogue.

// Self-contained for NVRTC (no system headers): the integer types and CUtensorMap's shape here.
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <cstdint>
#endif
#include "wgmma_rs.cuh"

// A TMA descriptor as the driver encodes it (cuda.h's CUtensorMap: 128 bytes, 64-byte aligned)
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

namespace {

constexpr int BK = 64;                      // K per step
// Scale bytes are read from global memory this many steps before their use. One step ahead left the
// load's latency exposed where steps are short: 32-row blocks at 512 tokens took 2.86 ms (the
// variant without MMA 2.39), 4 ahead 2.67 (2.14); 0.97x at 2048 tokens (128 + 64-row tails), level
// at 8192 (H200, benchmarks/NOTES.md). 8 ahead spills at 128 rows.
#ifndef SCALE_AHEAD
#define SCALE_AHEAD 4
#endif
constexpr int BOX_PAIRS = 32;               // pair rows per weight box (64 weight rows: one m64 block)
constexpr int W_BOX_BYTES = BOX_PAIRS * BK;  // 2 KB: 64 bytes of K per pair row

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  // (not .aligned: the loading warp's thread 0 comes from its own loop)
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// A predicated arrive: no branch between the wgmma of a step (ptxas serializes wgmma across branches)
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(int(pred))
      : "memory");
}

// A consumer warp's release of a ring slot: lane 0 arrives on this program's barrier and, in a
// cluster of 2, on the peer's (its loader multicasts into this program's slot too). Predicated, not
// branched (see mbar_arrive_if).
template <int CLUSTER>
__device__ __forceinline__ void release_slot(uint64_t* bar, bool pred) {
  if constexpr (CLUSTER == 1) {
    mbar_arrive_if(bar, pred);
  } else {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        ".reg .b32 remote;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "mapa.shared::cluster.u32 remote, %0, %2;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "@p mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(int(pred)), "r"(cluster_rank() ^ 1)
        : "memory");
  }
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The same box into this program's and its cluster peer's shared memory (same offset), each
// program's barrier at that offset told of the bytes
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps a register's value where it is until this point: the registers an in-flight wgmma reads
// must not be reused by the compiler before the wait that retires it (ptxas does not guard them).
__device__ __forceinline__ void keep(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The descriptor of a [rows, 64] bf16 tile stored by TMA with the 128-byte swizzle (8-row groups
// 1024 bytes apart), K-major, starting ``byte_offset`` bytes into K (a multiple of 32: k16 chunks).
__device__ __forceinline__ uint64_t tile_descriptor(uint32_t tile_addr, uint32_t byte_offset) {
  uint64_t start = ((tile_addr + byte_offset) & 0x3FFFF) >> 4;
  return start | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// An E4M3 block-scale byte -> bf16x2 of scale * 2^104 in both halves (exact; the sign dropped,
// scales are >= 0): the 7 exponent/mantissa bits moved into bf16's fields read as scale * 2^-120,
// times 2^112 twice.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t byte) {
  uint32_t out;
  asm("{\n"
      ".reg .b32 t, c;\n"
      "mov.b32 c, 0x77807780;\n"
      "and.b32 t, %1, 0x7F; shl.b32 t, t, 4; prmt.b32 t, t, 0, 0x1010;\n"
      "mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 %0, t, c;\n"
      "}"
      : "=r"(out)
      : "r"(byte));
  return out;
}

// One paired word -> the four bf16x2 A registers of a k16 chunk (rows r, r + 8; columns 2t, 2t + 1
// and 8 + 2t, 8 + 2t + 1), each times its row's scale: ../triton_moe/kernels.py's decode.
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t sr, uint32_t sr8, uint32_t (&a)[4]) {
  asm("{\n"
      ".reg .b32 t;\n"
      "and.b32 %0, %4, 0x81C081C0;\n"
      "shf.l.wrap.b32 t, %4, %4, 10; and.b32 %1, t, 0x81C081C0;\n"
      "shf.l.wrap.b32 t, %4, %4, 13; and.b32 %2, t, 0x81C081C0;\n"
      "and.b32 t, %4, 0x001B001B; mul.lo.u32 t, t, 0x4108; and.b32 %3, t, 0x81C081C0;\n"
      "mul.rn.bf16x2 %0, %0, %5;\n"
      "mul.rn.bf16x2 %1, %1, %6;\n"
      "mul.rn.bf16x2 %2, %2, %5;\n"
      "mul.rn.bf16x2 %3, %3, %6;\n"
      "}"
      : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
      : "r"(w), "r"(sr), "r"(sr8));
}

template <int BM>
__device__ __forceinline__ void wgmma_rs(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (BM == 128) wgmma_rs_n128(d, a, desc);
  else if constexpr (BM == 64) wgmma_rs_n64(d, a, desc);
  else if constexpr (BM == 32) wgmma_rs_n32(d, a, desc);
  else wgmma_rs_n16(d, a, desc);
}

// Natural K index -> its column in fragment order (chunk 64): layout.fragment_column.
__device__ __forceinline__ int fragment_column(int k) {
  int kp = k & 63;
  return k - kp + 16 * ((kp & 15) >> 2) + 8 * (kp & 1) + 2 * (kp >> 4) + ((kp >> 1) & 1);
}

struct Args {
  const uint8_t* scales;      // [E, R, K/16] E4M3
  const float* global_scale;  // [E]
  void* out;                  // GEMM1: h [S, N_OUT] bf16 (K of GEMM2 in fragment order); GEMM2: y [slots, N_OUT] f32
  const float* topk_weights;  // [slots] (GEMM2)
  const int* sorted_slot;     // [S] (GEMM2)
  const int* block_expert;    // [blocks], -1 unused
  const int* row_start;
  const int* row_end;
  int n_out;                  // GEMM1: I; GEMM2: H
  int k;                      // GEMM1: H; GEMM2: I
  int rows_per_expert;        // R: GEMM1 2I, GEMM2 H
  int num_blocks;
};

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Asynchronous copies of staged output rows to global memory (fire and forget; the staging buffer is
// reused once the copies have read it)
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared_bf16(uint32_t addr, float v) {  // rounded to nearest even
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(b) : "memory");
}

// DIAG (diagnostics, wrong results), bits that combine: 1 no decode (A a constant), 2 no MMA (the
// decoded registers XOR-ed into the result instead), 4 no copies of the outputs to global memory.
//
// Persistent: each program walks the tiles (weight tile t fastest, then row block) from its index in
// steps of the grid. The loader runs ahead across tiles, so the ring is full when the MMA warpgroups
// come back from an epilogue; the epilogue stages each m64 block's outputs in shared memory and
// copies each token's row with one asynchronous bulk copy (rows of a block are contiguous in the
// output but the block may end mid-row-range, so no TMA store of the whole box).
//
// CLUSTER 2: two programs of a cluster take adjacent weight tiles of the same row block and share its
// activation tiles: each loads half the rows of every tile and multicasts them to both, halving
// the activations' L2 traffic (16 of a step's 24 KB at 128 rows). A slot is then refilled only
// once the consumers of both programs released it.
template <bool GEMM1, int BM, int STAGES, int DIAG, int CLUSTER>
__device__ __forceinline__ void prefill_gemm(const TensorMap* x_map, const TensorMap* w_map, const Args& args) {
  constexpr int X_TILE_BYTES = BM * BK * 2;
  constexpr int SLOT_BYTES = X_TILE_BYTES + 4 * W_BOX_BYTES;
  constexpr int OUT_ROW_BYTES = (GEMM1 ? 128 : 256) + 16;  // 64 outputs of a token (+16: fewer bank conflicts)
  constexpr int OUT_STAGE_BYTES = BM * OUT_ROW_BYTES;
  extern __shared__ uint8_t smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes; the descriptors assume tiles aligned to it
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* x_tiles = smem;                          // [STAGES][BM][64] bf16, swizzled
  uint8_t* w_boxes = smem + STAGES * X_TILE_BYTES;  // [STAGES][2 warpgroups][2 blocks][32][64]
  uint8_t* out_stage = smem + STAGES * SLOT_BYTES;  // [2 warpgroups][BM][OUT_ROW_BYTES]
  float* routes = reinterpret_cast<float*>(out_stage + 2 * OUT_STAGE_BYTES);  // [2 warpgroups][BM] (GEMM2)
  uint64_t* full = reinterpret_cast<uint64_t*>(routes + 2 * BM);
  uint64_t* empty = full + STAGES;

  const int nk = args.k / BK;
  const int n_tiles = args.n_out / (GEMM1 ? 128 : 256);
  const int total = n_tiles * args.num_blocks;  // (n_tiles even: a cluster's tiles share a row block)
  const int warpgroup = threadIdx.x / 128;
  const int rank = CLUSTER == 1 ? 0 : cluster_rank();
  const int first = blockIdx.x / CLUSTER, units = total / CLUSTER, unit_step = gridDim.x / CLUSTER;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CLUSTER);  // each consumer warp of the cluster, after its wait for the wgmma
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CLUSTER == 1) __syncthreads();
  else cluster_sync();  // the peer's barriers exist before anything is multicast or arrives there

  // weight row (within the expert) of m64 block ``blk`` of consumer warpgroup ``wg`` in tile t
  auto block_row = [&](int t, int wg, int blk) {
    return GEMM1 ? 128 * t + 64 * wg + blk * (args.rows_per_expert / 2) : 256 * t + 128 * wg + 64 * blk;
  };
  // this program's tile of work unit ``unit`` (expert -1: an unused row block, skipped by all roles)
  struct Tile {
    int t, e, row0, nrows;
  };
  auto tile_of = [&](int unit) {
    const int tile = unit * CLUSTER + rank;
    const int b = tile / n_tiles;
    const int e = args.block_expert[b];
    const int row0 = e < 0 ? 0 : args.row_start[b];
    return Tile{tile % n_tiles, e, row0, e < 0 ? 0 : args.row_end[b] - row0};
  };

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int it = 0;  // steps issued, over all tiles: slot it % STAGES, its use number it / STAGES
      for (int unit = first; unit < units; unit += unit_step) {
        const auto [t, e, row0, nrows] = tile_of(unit);
        if (e < 0) continue;
        const int expert_pairs = e * (args.rows_per_expert / 2);
        for (int k = 0; k < nk; ++k, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
          mbar_expect_tx(&full[s], SLOT_BYTES);
          if constexpr (CLUSTER == 1) {
            tma_load_2d(x_tiles + s * X_TILE_BYTES, x_map, &full[s], k * BK, row0);
          } else {
            tma_load_2d_multicast(x_tiles + s * X_TILE_BYTES + rank * (X_TILE_BYTES / 2), x_map, &full[s], k * BK,
                                  row0 + rank * (BM / 2), 3);
          }
          for (int wg = 0; wg < 2; ++wg)
            for (int blk = 0; blk < 2; ++blk)
              tma_load_2d(w_boxes + ((s * 2 + wg) * 2 + blk) * W_BOX_BYTES, w_map, &full[s], k * BK,
                          expert_pairs + block_row(t, wg, blk) / 2);
        }
      }
    }
  } else {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int pair = 8 * warp + lane / 4;  // this thread's pair row in each box: rows rho, rho + 8
  const int quad = lane % 4;             // its words 4 quad .. 4 quad + 3 of a step, block ``quad``
  const int rho = 16 * warp + lane / 4;
  const uint32_t stage_addr = smem_addr(out_stage + wg * OUT_STAGE_BYTES);
  float* my_routes = routes + wg * BM;

  uint32_t a[4][2][4];  // [k16 chunk][block][register]
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[j][blk][r] = 0;
  uint32_t sink = 0;  // DIAG 2
  int it = 0;

  for (int unit = first; unit < units; unit += unit_step) {
    const auto [t, e, row0, nrows] = tile_of(unit);
    if (e < 0) continue;

    // the thread's scale bytes: block ``blk``, rows rho (h = 0) and rho + 8 (h = 1), step k at + 4k;
    // loaded SCALE_AHEAD steps before their use (raw[k % SCALE_AHEAD])
    const uint8_t* srow[2][2];
    uint32_t raw[SCALE_AHEAD][2][2];
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        srow[blk][h] = args.scales + (int64_t(e) * args.rows_per_expert + block_row(t, wg, blk) + rho + 8 * h) *
                                         (args.k / 16) + quad;
#pragma unroll
        for (int q = 0; q < SCALE_AHEAD; ++q) raw[q][blk][h] = __ldg(srow[blk][h] + 4 * q);
      }

    float acc[2][BM / 2];
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[blk][i] = 0.f;

    for (int k0 = 0; k0 < nk; k0 += SCALE_AHEAD)  // (nk a multiple of SCALE_AHEAD: prefill.py checks)
#pragma unroll
    for (int q = 0; q < SCALE_AHEAD; ++q, ++it) {
      const int k = k0 + q;
      const int s = it % STAGES;
      uint32_t sc[2][2];
#pragma unroll
      for (int blk = 0; blk < 2; ++blk)
#pragma unroll
        for (int h = 0; h < 2; ++h) sc[blk][h] = scale_bf16x2(raw[q][blk][h]);
      if (k + SCALE_AHEAD < nk) {
#pragma unroll
        for (int blk = 0; blk < 2; ++blk)
#pragma unroll
          for (int h = 0; h < 2; ++h) raw[q][blk][h] = __ldg(srow[blk][h] + 4 * (k + SCALE_AHEAD));
      }
      mbar_wait(&full[s], (it / STAGES) & 1);
      const uint32_t wbox = smem_addr(w_boxes + (s * 2 + wg) * 2 * W_BOX_BYTES + pair * BK + quad * 16);
      const uint4 words0 = lds128(wbox);
      const uint4 words1 = lds128(wbox + W_BOX_BYTES);
      const uint32_t w0[4] = {words0.x, words0.y, words0.z, words0.w};
      const uint32_t w1[4] = {words1.x, words1.y, words1.z, words1.w};
      const uint32_t x_tile = smem_addr(x_tiles + s * X_TILE_BYTES);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // chunk j of the previous step, the last reader of a[j], has retired once at most 3 groups are in flight
        wgmma_wait<3>();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          keep(a[j][0][r]);
          keep(a[j][1][r]);
        }
        // the previous step retired (this warp's wgmma; the warp's reads of its words long done)
        if (j == 3) release_slot<CLUSTER>(&empty[(it + STAGES - 1) % STAGES], it > 0 && lane == 0);
        if constexpr ((DIAG & 1) != 0) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[j][0][r] = a[j][1][r] = 0x3F803F80u ^ (w0[j] & w1[j] & 0x80000000u);
        } else {
          decode_word(w0[j], sc[0][0], sc[0][1], a[j][0]);
          decode_word(w1[j], sc[1][0], sc[1][1], a[j][1]);
        }
        wgmma_fence();
        const uint64_t desc = tile_descriptor(x_tile, 32 * j);
        if constexpr ((DIAG & 2) != 0) {
#pragma unroll
          for (int r = 0; r < 4; ++r) sink ^= a[j][0][r] ^ a[j][1][r];
        } else {
          wgmma_rs<BM>(acc[0], a[j][0], desc);
          wgmma_rs<BM>(acc[1], a[j][1], desc);
        }
        wgmma_commit();
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) keep(acc[blk][i]);
    if constexpr ((DIAG & 2) != 0) acc[0][0] += __uint_as_float(sink & 0x807FFFFFu);

    // accumulator fragment: register 4i + 2h + c is weight row rho + 8h, token 8i + 2 quad + c
    const float g = args.global_scale[e] * 4194304.0f;  // the decoded values' 2^-22
    if constexpr (GEMM1) {
      bulk_wait_read();  // this thread's copies of the last tile have read the staging rows
      named_barrier(1 + wg, 128);
#pragma unroll
      for (int i = 0; i < BM / 8; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float gate = acc[0][4 * i + 2 * h + c] * g;
            const float up = acc[1][4 * i + 2 * h + c] * g;
            const int n = 8 * i + 2 * quad + c;
            st_shared_bf16(stage_addr + n * OUT_ROW_BYTES + 2 * fragment_column(rho + 8 * h),
                           gate / (1.0f + __expf(-gate)) * up);
          }
      fence_async_shared();
      named_barrier(1 + wg, 128);
      if (tid < nrows && (DIAG & 4) == 0) {
        uint16_t* dst = static_cast<uint16_t*>(args.out) + int64_t(row0 + tid) * args.n_out + 128 * t + 64 * wg;
        bulk_store(dst, stage_addr + tid * OUT_ROW_BYTES, 128);
      }
    } else {
      if (tid < BM) my_routes[tid] = tid < nrows ? args.topk_weights[args.sorted_slot[row0 + tid]] * g : 0.f;
      const int slot = tid < nrows ? args.sorted_slot[row0 + tid] : 0;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        bulk_wait_read();
        named_barrier(1 + wg, 128);  // (also: the routes are in shared memory)
#pragma unroll
        for (int i = 0; i < BM / 8; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int n = 8 * i + 2 * quad + c;
            const float route = my_routes[n];
#pragma unroll
            for (int h = 0; h < 2; ++h)
              st_shared_f32(stage_addr + n * OUT_ROW_BYTES + 4 * (rho + 8 * h), acc[blk][4 * i + 2 * h + c] * route);
          }
        fence_async_shared();
        named_barrier(1 + wg, 128);
        if (tid < nrows && (DIAG & 4) == 0) {
          float* dst = static_cast<float*>(args.out) + int64_t(slot) * args.n_out + 256 * t + 128 * wg + 64 * blk;
          bulk_store(dst, stage_addr + tid * OUT_ROW_BYTES, 256);
        }
      }
      named_barrier(1 + wg, 128);  // the routes are read before the next tile writes them
    }
  }
  bulk_wait_all();
  }
  // a program leaves only when its peer no longer multicasts into it nor arrives on its barriers
  if constexpr (CLUSTER == 2) cluster_sync();
}

}  // namespace

#define PREFILL_KERNEL(NAME, GEMM1, BM, STAGES, DIAG)                                                       \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                     \
      NAME(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map, Args args) { \
    prefill_gemm<GEMM1, BM, STAGES, DIAG, 1>(&x_map, &w_map, args);                                      \
  }                                                                                                        \
  extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)                           \
      NAME##_c2(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map, Args args) { \
    prefill_gemm<GEMM1, BM, STAGES, DIAG, 2>(&x_map, &w_map, args);                                      \
  }

// ring slots: as many as fit beside the output staging (prefill.py's shared_bytes)
PREFILL_KERNEL(gemm1_bm128, true, 128, 6, 0)
PREFILL_KERNEL(gemm2_bm128, false, 128, 6, 0)
PREFILL_KERNEL(gemm1_bm64, true, 64, 8, 0)
PREFILL_KERNEL(gemm2_bm64, false, 64, 8, 0)
PREFILL_KERNEL(gemm1_bm32, true, 32, 8, 0)
PREFILL_KERNEL(gemm2_bm32, false, 32, 8, 0)
PREFILL_KERNEL(gemm1_bm128_diag1, true, 128, 6, 1)
PREFILL_KERNEL(gemm2_bm128_diag1, false, 128, 6, 1)
PREFILL_KERNEL(gemm1_bm128_diag2, true, 128, 6, 2)
PREFILL_KERNEL(gemm2_bm128_diag2, false, 128, 6, 2)
PREFILL_KERNEL(gemm1_bm128_diag4, true, 128, 6, 4)
PREFILL_KERNEL(gemm2_bm128_diag4, false, 128, 6, 4)
PREFILL_KERNEL(gemm1_bm128_diag5, true, 128, 6, 5)
PREFILL_KERNEL(gemm2_bm128_diag5, false, 128, 6, 5)
PREFILL_KERNEL(gemm1_bm128_diag7, true, 128, 6, 7)
PREFILL_KERNEL(gemm2_bm128_diag7, false, 128, 6, 7)
PREFILL_KERNEL(gemm1_bm64_diag1, true, 64, 8, 1)
PREFILL_KERNEL(gemm2_bm64_diag1, false, 64, 8, 1)
PREFILL_KERNEL(gemm1_bm64_diag2, true, 64, 8, 2)
PREFILL_KERNEL(gemm2_bm64_diag2, false, 64, 8, 2)
PREFILL_KERNEL(gemm1_bm64_diag4, true, 64, 8, 4)
PREFILL_KERNEL(gemm2_bm64_diag4, false, 64, 8, 4)
PREFILL_KERNEL(gemm1_bm64_diag5, true, 64, 8, 5)
PREFILL_KERNEL(gemm2_bm64_diag5, false, 64, 8, 5)
PREFILL_KERNEL(gemm1_bm64_diag7, true, 64, 8, 7)
PREFILL_KERNEL(gemm2_bm64_diag7, false, 64, 8, 7)
PREFILL_KERNEL(gemm1_bm32_diag1, true, 32, 8, 1)
PREFILL_KERNEL(gemm2_bm32_diag1, false, 32, 8, 1)
PREFILL_KERNEL(gemm1_bm32_diag2, true, 32, 8, 2)
PREFILL_KERNEL(gemm2_bm32_diag2, false, 32, 8, 2)
PREFILL_KERNEL(gemm1_bm32_diag4, true, 32, 8, 4)
PREFILL_KERNEL(gemm2_bm32_diag4, false, 32, 8, 4)
PREFILL_KERNEL(gemm1_bm32_diag5, true, 32, 8, 5)
PREFILL_KERNEL(gemm2_bm32_diag5, false, 32, 8, 5)
PREFILL_KERNEL(gemm1_bm32_diag7, true, 32, 8, 7)
PREFILL_KERNEL(gemm2_bm32_diag7, false, 32, 8, 7)
