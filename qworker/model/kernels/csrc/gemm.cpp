// The GEMM of gemm.h for torch's linear layers (`qworker.model.native.gemm`).
#include "gemm.h"
#include "gemm_amx.h"

namespace {

template <typename T>
int run(const void* x, const void* wp, const void* bias, void* out, int64_t m, int64_t n,
        int64_t k) {
  if (!qw::gemm_serves<T>(m, n, k)) return 0;
#pragma omp parallel
  qw::gemm(static_cast<const T*>(x), static_cast<const T*>(wp), static_cast<const T*>(bias),
           static_cast<T*>(out), m, n, k);
  return 1;
}

}  // namespace

// each returns 0 when it did not compute (shape or CPU not served): the caller uses its own matmul
extern "C" int qw_gemm_f32(const void* x, const void* wp, const void* bias, void* out, int64_t m,
                           int64_t n, int64_t k) {
  return run<float>(x, wp, bias, out, m, n, k);
}

extern "C" int qw_gemm_bf16(const void* x, const void* wp, const void* bias, void* out, int64_t m,
                            int64_t n, int64_t k) {
  return run<qw::bf16>(x, wp, bias, out, m, n, k);
}

// which of the two the build serves: bit 0 float32, bit 1 bfloat16
extern "C" int qw_gemm_available() {
  return (qw::GemmOp<float>::kServed ? 1 : 0) | (qw::GemmOp<qw::bf16>::kServed ? 2 : 0);
}

// the AMX tiles' GEMM (gemm_amx.h), bfloat16 only; 0 where this build or shape has none
extern "C" int qw_gemm_amx_bf16(const void* x, const void* wp, const void* bias, void* out,
                                int64_t m, int64_t n, int64_t k) {
#if defined(QW_GEMM_AMX)
  if (!qw::amx::serves(m, n, k)) return 0;
  using qw::bf16;
#pragma omp parallel
  qw::amx::gemm(static_cast<const bf16*>(x), static_cast<const bf16*>(wp),
                static_cast<const bf16*>(bias), static_cast<bf16*>(out), m, n, k);
  return 1;
#else
  (void)x, (void)wp, (void)bias, (void)out, (void)m, (void)n, (void)k;
  return 0;
#endif
}

// whether this build has the AMX GEMM and the OS lets this process use the tiles (asked once)
extern "C" int qw_amx_ready() {
#if defined(QW_GEMM_AMX)
  return qw::amx::tiles_ready() ? 1 : 0;
#else
  return 0;
#endif
}
