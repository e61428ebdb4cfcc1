// Portable SIMD for our CPU kernels: GCC vector extensions, 16 floats wide.
// Built with -march=native on the machine that runs them, they become AVX-512,
// AVX2 (two halves) or SSE code without intrinsics.

#pragma once

#include <cstring>

namespace {

constexpr int W = 16;  // floats per vector
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int vi __attribute__((vector_size(W * sizeof(int))));

// Unaligned loads and stores of either vector type: load(p) is a vf, load<vn>(p) a vn.
template <typename V = vf>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// x - 0 is x for every x, -0 included (0 + x is not, for x = -0), so the compiler folds it to a
// plain broadcast; vf{} + x costs a scalar add before each one.
inline vf splat(float x) { return x - vf{}; }

// A tree of shuffles: a plain loop over the lanes compiles to 15 dependent scalar adds.
inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The machine's own registers, for register-blocked loops (small_linear, attention's chunks): on
// AVX2, GCC keeps a block of 16-float vf accumulators in memory, round-tripping every one through
// the stack at each step, which leaves such a loop far behind oneDNN (docs/engine.md, "CPU kernels").
#ifdef __AVX512F__
constexpr int NW = 16;      // floats per register
constexpr int NREGS = 32;   // vector registers
#else
constexpr int NW = 8;
constexpr int NREGS = 16;
#endif
typedef float vn __attribute__((vector_size(NW * sizeof(float))));

inline vn splat_n(float x) { return x - vn{}; }  // a broadcast: see splat

// Keeps a loaded vector in a register: GCC would otherwise fold a reload into each FMA that uses it
// (twice the loads). Without AVX a vn does not fit one register, and the constraint cannot be met.
#ifdef __AVX__
#define IN_REGISTER(v) asm("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

inline float hsum_n(vn v) {
#ifdef __AVX512F__
  return hsum(v);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
#endif
}

// exp(x) to about 1 ulp (Cephes' expf polynomial) over [-87.3, 88]: a scalar libm
// call per element would cost more than the memory traffic these kernels save.
// For vf and for vn (the registers' own width, which GCC keeps out of the stack on AVX2).
template <typename F>
inline F vexp(F x) {
  typedef int I __attribute__((vector_size(sizeof(F))));
  const F lo = F{} - 87.3f, hi = F{} + 88.f, zero{};
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F t = x * 1.44269504088896341f;
  const I n = __builtin_convertvector(t + (t < zero ? zero - 0.5f : zero + 0.5f), I);
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  F p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F y = p * r * r + r + 1.f;
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace
