// Numeric check of the simulated cuBLAS's GEMM arithmetic (gpu-sim/src/gemm.h), without the
// driver, against naive references:
//   * a naive reference in long double (extended precision on x86-64) of the products of the
//     values the mode computes with, within the classical bound gamma(k+2) * (|alpha| sum |a b| +
//     |beta c|) for the compute precision plus half an ulp of the storage type (named tolerances
//     below);
//   * a scalar reference in the compute type with the documented order (acc = 0; acc += a*b for
//     p = 0..k-1; alpha*acc (+ beta*c)), which must agree bit for bit (when the compiler cannot
//     contract a*b+c into an FMA, i.e. without hardware FMA in the target, as x86-64's default);
//   * for the f16-accumulation mode, a scalar reference whose binary16 rounding is computed
//     independently (scaling and rounding half to even), bit for bit.
// Every case fills the padding between columns (ld > rows) and between batches with sentinels
// and checks they are untouched. Also: the 16-bit conversions against tests/emu/emu_half.h,
// TF32 rounding on known values, gemm::extent, and the speed of an im2col-sized f32 GEMM.
//
// Build and run from the repository root:
//   g++ -std=c++17 -O2 -Wall -Werror -I gpu-sim/src -I tests/emu
//       gpu-sim/tests/blas_ref.cpp -o /tmp/blas_ref && /tmp/blas_ref
// Prints one line per case and exits non-zero if any check failed.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "emu_half.h"
#include "gemm.h"

using gemm::Mode;
using gemm::Type;

namespace {

// ------------------------------------------------------------------------- named tolerances
// Unit roundoffs of the compute precisions and of the storage types.
constexpr double kUnitF64 = 0x1p-53;
constexpr double kUnitF32 = 0x1p-24;
constexpr double kUnitF16 = 0x1p-11;
constexpr double kUnitBF16 = 0x1p-8;
// Required speed of the f32 GEMM of an im2col convolution (m=64, n=8192, k=576) at -O2.
constexpr double kMinGflops = 1.0;

int failures = 0;
void fail(const std::string& what) {
    ++failures;
    if (failures <= 60) std::printf("  FAIL %s\n", what.c_str());
}

// Deterministic values in [-1, 1) (SplitMix64-driven, the same on every platform).
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    double uniform() { return (double)(next() >> 11) * 0x1p-52 - 1.0; }
};

// ------------------------------------------------------------------------------ storage
// Values of any type in a byte buffer, read and written as double.
double get(Type t, const std::vector<uint8_t>& buf, int64_t i) {
    switch (t) {
        case Type::F64: {
            double v;
            std::memcpy(&v, buf.data() + i * 8, 8);
            return v;
        }
        case Type::F32: {
            float v;
            std::memcpy(&v, buf.data() + i * 4, 4);
            return v;
        }
        case Type::F16: {
            uint16_t b;
            std::memcpy(&b, buf.data() + i * 2, 2);
            return gemm::half_to_float(b);
        }
        default: {
            uint16_t b;
            std::memcpy(&b, buf.data() + i * 2, 2);
            return gemm::bf16_to_float(b);
        }
    }
}
// Stores v rounded to the type (v is exact in float for the 16-bit types here).
void put(Type t, std::vector<uint8_t>& buf, int64_t i, double v) {
    switch (t) {
        case Type::F64: std::memcpy(buf.data() + i * 8, &v, 8); break;
        case Type::F32: {
            float f = (float)v;
            std::memcpy(buf.data() + i * 4, &f, 4);
            break;
        }
        case Type::F16: {
            uint16_t b = gemm::float_to_half((float)v);
            std::memcpy(buf.data() + i * 2, &b, 2);
            break;
        }
        default: {
            uint16_t b = gemm::float_to_bf16((float)v);
            std::memcpy(buf.data() + i * 2, &b, 2);
            break;
        }
    }
}
bool same_bits(Type t, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t i) {
    const size_t e = gemm::type_size(t);
    return std::memcmp(a.data() + i * e, b.data() + i * e, e) == 0;
}
double unit_of(Type t) {
    switch (t) {
        case Type::F64: return kUnitF64;
        case Type::F32: return kUnitF32;
        case Type::F16: return kUnitF16;
        default: return kUnitBF16;
    }
}

// ------------------------------------------------------------ an independent binary16 rounding
// x (finite double) rounded to the nearest binary16 value, ties to even, by scaling to the
// quantum at x's exponent and rounding the integer part (no bit tricks shared with gemm.h).
double ref_round_half(double x) {
    if (x == 0 || std::isnan(x)) return x;
    const double a = std::fabs(x);
    int e;
    std::frexp(a, &e);                        // a in [2^(e-1), 2^e)
    const int q = std::max(e - 1, -14) - 10;  // quantum: 10 bits below the leading one
    const double s = std::ldexp(a, -q), fl = std::floor(s), d = s - fl;
    double r = (d > 0.5 || (d == 0.5 && std::fmod(fl, 2.0) != 0)) ? fl + 1 : fl;
    double v = std::ldexp(r, q);
    if (v > 65504.0) v = HUGE_VAL;
    return x < 0 ? -v : v;
}

// ----------------------------------------------------------------------------- one case
struct Case {
    const char* name;
    bool ta = false, tb = false;
    int64_t m = 1, n = 1, k = 1;
    int64_t pad_a = 0, pad_b = 0, pad_c = 0;  // ld = rows + pad
    int64_t batch = 1;
    int64_t gap_a = 0, gap_b = 0, gap_c = 0;  // stride = one matrix's extent + gap (-1: stride 0)
    Type a = Type::F32, c = Type::F32;
    Mode mode = Mode::F32;
    double alpha = 1, beta = 0;
    bool nan_c = false;  // C starts as NaN (beta must be 0)
    bool nan_a = false;  // A is NaN (alpha or k must be 0)
    uint64_t seed = 1;
};

// The value each input has in the computation (the mode's input rounding of f32 data).
double as_computed(Mode mode, Type t, double v) {
    if (t != Type::F32) return v;
    switch (mode) {
        case Mode::F32_TF32: return gemm::round_tf32((float)v);
        case Mode::F32_F16: return gemm::half_to_float(gemm::float_to_half((float)v));
        case Mode::F32_BF16: return gemm::bf16_to_float(gemm::float_to_bf16((float)v));
        default: return v;
    }
}

void run_case(const Case& cs, bool print = true) {
    Rng rng{cs.seed * 0x1234567ull + 99};
    const Type at = cs.a, ct = cs.c;
    const int64_t ar = cs.ta ? cs.k : cs.m, ac = cs.ta ? cs.m : cs.k;  // A as stored
    const int64_t br = cs.tb ? cs.n : cs.k, bc = cs.tb ? cs.k : cs.n;  // B as stored
    const int64_t lda = ar + cs.pad_a, ldb = br + cs.pad_b, ldc = cs.m + cs.pad_c;
    auto one = [](int64_t ld, int64_t rows, int64_t cols) {
        return cols > 0 && rows > 0 ? ld * (cols - 1) + rows : 0;
    };
    const int64_t sa = cs.gap_a < 0 ? 0 : one(lda, ar, ac) + cs.gap_a;
    const int64_t sb = cs.gap_b < 0 ? 0 : one(ldb, br, bc) + cs.gap_b;
    const int64_t sc = one(ldc, cs.m, cs.n) + cs.gap_c;
    const int64_t na = std::max<int64_t>(1, sa * (cs.batch - 1) + one(lda, ar, ac));
    const int64_t nb = std::max<int64_t>(1, sb * (cs.batch - 1) + one(ldb, br, bc));
    const int64_t nc = std::max<int64_t>(1, sc * (cs.batch - 1) + one(ldc, cs.m, cs.n));
    std::vector<uint8_t> A(na * gemm::type_size(at)), B(nb * gemm::type_size(at)),
        C(nc * gemm::type_size(ct));
    const double sentinel = 12345.0;  // in every padding slot; exact in every type
    for (int64_t i = 0; i < na; i++) put(at, A, i, cs.nan_a ? NAN : rng.uniform());
    for (int64_t i = 0; i < nb; i++) put(at, B, i, rng.uniform());
    std::vector<bool> c_used(nc, false);
    for (int64_t bi = 0; bi < cs.batch; bi++)
        for (int64_t j = 0; j < cs.n; j++)
            for (int64_t i = 0; i < cs.m; i++) c_used[bi * sc + i + j * ldc] = true;
    for (int64_t i = 0; i < nc; i++)
        put(ct, C, i, !c_used[i] ? sentinel : cs.nan_c ? NAN : 4 * rng.uniform());
    const std::vector<uint8_t> C0 = C;

    gemm::Problem pr;
    pr.trans_a = cs.ta;
    pr.trans_b = cs.tb;
    pr.m = cs.m;
    pr.n = cs.n;
    pr.k = cs.k;
    pr.a_type = pr.b_type = at;
    pr.c_type = ct;
    pr.a = A.data();
    pr.lda = lda;
    pr.stride_a = sa;
    pr.b = B.data();
    pr.ldb = ldb;
    pr.stride_b = sb;
    pr.c = C.data();
    pr.ldc = ldc;
    pr.stride_c = sc;
    pr.batch = cs.batch;
    pr.mode = cs.mode;
    pr.alpha = cs.alpha;
    pr.beta = cs.beta;
    if (!gemm::run(pr)) {
        fail(std::string(cs.name) + ": gemm::run refused the types");
        return;
    }

    const bool f64 = cs.mode == Mode::F64, f16acc = cs.mode == Mode::F16;
#ifdef __FP_FAST_FMAF
    const bool exact_order = false;  // the compiler may contract a*b+c differently per path
#else
    const bool exact_order = true;
#endif
    const double u = f64 ? kUnitF64 : f16acc ? kUnitF16 : kUnitF32;
    double worst = 0;  // largest error / bound
    int64_t bit_mismatch = 0, checked = 0;
    std::vector<uint8_t> want(gemm::type_size(ct));
    for (int64_t bi = 0; bi < cs.batch; bi++)
        for (int64_t j = 0; j < cs.n; j++)
            for (int64_t i = 0; i < cs.m; i++) {
                const int64_t ci = bi * sc + i + j * ldc;
                auto a_at = [&](int64_t p) {
                    const int64_t idx = bi * sa + (cs.ta ? p + i * lda : i + p * lda);
                    return as_computed(cs.mode, at, get(at, A, idx));
                };
                auto b_at = [&](int64_t p) {
                    const int64_t idx = bi * sb + (cs.tb ? j + p * ldb : p + j * ldb);
                    return as_computed(cs.mode, at, get(at, B, idx));
                };
                const double c0 = get(ct, C0, ci), got = get(ct, C, ci);
                const bool ab = cs.k > 0 && cs.alpha != 0;
                // f64 reference and its bound.
                long double sum = 0, mag = 0;  // x87 extended on x86-64: 11 bits beyond f64
                if (ab)
                    for (int64_t p = 0; p < cs.k; p++) {
                        sum += (long double)a_at(p) * b_at(p);
                        mag += std::fabs((long double)a_at(p) * b_at(p));
                    }
                long double refl = ab ? cs.alpha * sum : 0;
                double scale = ab ? (double)(std::fabs(cs.alpha) * mag) : 0;
                if (cs.beta != 0) {
                    refl += (long double)cs.beta * c0;
                    scale += std::fabs(cs.beta * c0);
                }
                const double ref = (double)refl;
                const double kk = (double)cs.k + 3;
                const double bound =
                    kk * u / (1 - kk * u) * scale + unit_of(ct) * std::fabs(ref) + 1e-300;
                checked++;
                if (std::isnan(got) || std::fabs(got - ref) > bound) {
                    char b[256];
                    std::snprintf(b, sizeof b,
                                  "%s: C[%lld] (batch %lld, i %lld, j %lld) = %.9g, f64 reference "
                                  "%.9g, bound %.3g",
                                  cs.name, (long long)ci, (long long)bi, (long long)i, (long long)j,
                                  got, ref, bound);
                    fail(b);
                    continue;
                }
                worst = std::max(worst, std::fabs(got - ref) / bound);
                // Bit-exact references in the documented order.
                if (f16acc) {
                    double acc = 0;
                    if (ab)
                        for (int64_t p = 0; p < cs.k; p++)
                            acc = ref_round_half(acc + a_at(p) * b_at(p));
                    double v = ref_round_half(cs.alpha * acc);
                    if (cs.beta != 0) v = ref_round_half(v + cs.beta * c0);
                    put(ct, want, 0, v);
                } else if (f64) {
                    double acc = 0;
                    double v;
                    if (ab) {
                        for (int64_t p = 0; p < cs.k; p++) acc += a_at(p) * b_at(p);
                        v = cs.alpha * acc;
                        if (cs.beta != 0) v += cs.beta * c0;
                    } else {
                        v = cs.beta == 0 ? 0.0 : cs.beta * c0;
                    }
                    put(ct, want, 0, v);
                } else {
                    float acc = 0, v;
                    const float al = (float)cs.alpha, be = (float)cs.beta;
                    if (ab) {
                        for (int64_t p = 0; p < cs.k; p++) acc += (float)a_at(p) * (float)b_at(p);
                        v = al * acc;
                        if (be != 0) v += be * (float)c0;
                    } else {
                        v = be == 0 ? 0.0f : be * (float)c0;
                    }
                    put(ct, want, 0, v);
                }
                if ((exact_order || f16acc) &&
                    std::memcmp(want.data(), C.data() + ci * gemm::type_size(ct), want.size()) !=
                        0) {
                    if (++bit_mismatch <= 3) {
                        char b[256];
                        std::snprintf(b, sizeof b,
                                      "%s: C[%lld] = %.9g differs in its bits from the in-order "
                                      "scalar reference %.9g",
                                      cs.name, (long long)ci, got, get(ct, want, 0));
                        fail(b);
                    }
                }
            }
    int64_t touched = 0;
    for (int64_t i = 0; i < nc; i++)
        if (!c_used[i] && !same_bits(ct, C, C0, i)) touched++;
    if (touched)
        fail(std::string(cs.name) + ": " + std::to_string(touched) +
             " padding elements of C were written");
    if (print)
        std::printf("%-58s %7lld values  max error/bound %.3f  bit-exact %s\n", cs.name,
                    (long long)checked, worst,
                    (exact_order || f16acc) ? (bit_mismatch ? "NO" : "yes") : "n/a (FMA target)");
}

// ---------------------------------------------------------------------- conversion checks
void check_conversions() {
    int64_t bad = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        __half h;
        uint16_t bb = (uint16_t)b;
        std::memcpy(&h, &bb, 2);
        const float want = __half2float(h), got = gemm::half_to_float(bb);
        if (!(std::isnan(want) && std::isnan(got)) &&
            gemm::float_to_bits(want) != gemm::float_to_bits(got))
            bad++;
        __nv_bfloat16 z;
        std::memcpy(&z, &bb, 2);
        const float wz = __bfloat162float(z), gz = gemm::bf16_to_float(bb);
        if (!(std::isnan(wz) && std::isnan(gz)) &&
            gemm::float_to_bits(wz) != gemm::float_to_bits(gz))
            bad++;
    }
    // float -> 16 bits: around every boundary (each value, the midpoints to its neighbours and
    // one float ulp either side), plus a stride through all floats.
    auto check_f = [&](float x) {
        const __half h = __float2half(x);
        uint16_t want, got = gemm::float_to_half(x);
        std::memcpy(&want, &h, 2);
        if (want != got) {
            if (++bad <= 5)
                std::printf("  float_to_half(%a) = 0x%04x, emu_half 0x%04x\n", x, got, want);
        }
        const __nv_bfloat16 z = __float2bfloat16(x);
        uint16_t wz, gz = gemm::float_to_bf16(x);
        std::memcpy(&wz, &z, 2);
        if (wz != gz) {
            if (++bad <= 5)
                std::printf("  float_to_bf16(%a) = 0x%04x, emu_half 0x%04x\n", x, gz, wz);
        }
    };
    int64_t n = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        for (int bf = 0; bf < 2; bf++) {
            const float v =
                bf ? gemm::bf16_to_float((uint16_t)b) : gemm::half_to_float((uint16_t)b);
            const float w = bf ? gemm::bf16_to_float((uint16_t)(b + 1))
                               : gemm::half_to_float((uint16_t)(b + 1));
            if (!std::isfinite(v)) continue;
            const float mid = std::isfinite(w) ? (float)(((double)v + (double)w) / 2) : v;
            for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY),
                            std::nextafter(mid, -INFINITY)}) {
                check_f(x);
                n++;
            }
        }
    }
    for (uint64_t b = 0; b < (1ull << 32); b += 4099) {
        check_f(gemm::bits_to_float((uint32_t)b));
        n++;
    }
    check_f(65504.0f);
    check_f(65519.996f);
    check_f(65520.0f);
    check_f(0x1p-25f);
    check_f(std::nextafter(0x1p-25f, 1.0f));
    check_f(3.4028235e38f);
    if (bad)
        fail("16-bit conversions: " + std::to_string(bad) + " differ from tests/emu/emu_half.h");
    std::printf("%-58s %7lld values  %s\n", "conversions f16/bf16 <-> f32 vs emu_half.h",
                (long long)(n + 131072), bad ? "MISMATCH" : "identical");
}

// gemm::double_to_half against the independent rounding, on boundaries and random doubles.
void check_double_to_half() {
    int64_t bad = 0, n = 0;
    auto check = [&](double x) {
        n++;
        const double want = ref_round_half(x), got = gemm::half_to_float(gemm::double_to_half(x));
        if (!(std::isnan(want) && std::isnan(got)) &&
            !(want == got && std::signbit(want) == std::signbit(got))) {
            if (++bad <= 5) std::printf("  double_to_half(%a) = %a, want %a\n", x, got, want);
        }
    };
    for (uint32_t b = 0; b < 0x7c00; b++) {
        const double v = gemm::half_to_float((uint16_t)b),
                     w = gemm::half_to_float((uint16_t)(b + 1));
        const double mid = (v + w) / 2;  // exact in double
        for (double x :
             {v, mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9), mid + 0x1p-60 * mid})
            for (double sx : {x, -x}) check(sx);
    }
    Rng rng{5};
    for (int i = 0; i < 1000000; i++) check(std::ldexp(rng.uniform(), (int)(rng.next() % 50) - 30));
    check(65520.0);
    check(1e300);
    check(-INFINITY);
    if (bad) fail("double_to_half: " + std::to_string(bad) + " wrong");
    std::printf("%-58s %7lld values  %s\n", "double -> f16 rounding vs an independent rounding",
                (long long)n, bad ? "WRONG" : "right");
}

void check_tf32() {
    struct {
        float in, out;
    } cases[] = {
        {1.0f, 1.0f},
        {1.0f + 0x1p-11f, 1.0f},                        // halfway, even below: down
        {1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-9f},          // halfway, odd below: up
        {1.0f + 0x1p-11f + 0x1p-20f, 1.0f + 0x1p-10f},  // above halfway: up
        {-(1.0f + 0x1p-11f + 0x1p-20f), -(1.0f + 0x1p-10f)},
        {3.4028235e38f, INFINITY},  // carries past the largest TF32 value
        {0x1p-149f, 0x0p0f},        // the smallest subnormal rounds to 0
        {0x1p-136f, 0x1p-136f},     // on the subnormal TF32 grid
        {INFINITY, INFINITY},
    };
    int bad = 0;
    for (auto& c : cases) {
        const float got = gemm::round_tf32(c.in);
        if (gemm::float_to_bits(got) != gemm::float_to_bits(c.out)) {
            bad++;
            std::printf("  round_tf32(%a) = %a, want %a\n", c.in, got, c.out);
        }
    }
    if (!std::isnan(gemm::round_tf32(NAN))) bad++;
    if (bad) fail("round_tf32");
    std::printf("%-58s %7d values  %s\n", "TF32 rounding on known values",
                (int)(sizeof cases / sizeof cases[0]) + 1, bad ? "WRONG" : "right");
}

void check_extent() {
    int bad = 0;
    int64_t lo;
    uint64_t len;
    auto expect = [&](bool ok, int64_t want_lo, uint64_t want_len, const char* what) {
        if (!ok || lo != want_lo || len != want_len) {
            bad++;
            std::printf("  extent %s: lo %lld len %llu, want %lld %llu\n", what, (long long)lo,
                        (unsigned long long)len, (long long)want_lo, (unsigned long long)want_len);
        }
    };
    expect(gemm::extent(3, 4, 5, 0, 1, 4, &lo, &len), 0, (5 * 3 + 3) * 4, "3x4 ld 5 f32");
    expect(gemm::extent(3, 4, 5, 100, 3, 2, &lo, &len), 0, (15 + 3 + 200) * 2,
           "batch 3 stride 100");
    expect(gemm::extent(3, 4, 5, -100, 3, 8, &lo, &len), -200 * 8, (200 + 18) * 8,
           "negative stride");
    expect(gemm::extent(3, 4, 5, 0, 7, 4, &lo, &len), 0, 18 * 4, "stride 0");
    expect(gemm::extent(0, 4, 5, 0, 1, 4, &lo, &len), 0, 0, "no rows");
    expect(gemm::extent(3, 4, 5, 10, 0, 4, &lo, &len), 0, 0, "no batch");
    if (gemm::extent(1 << 30, 1 << 30, 1 << 30, 0, 1, 8, &lo, &len)) {
        bad++;
        std::printf("  extent: 2^63 bytes accepted\n");
    }
    if (bad) fail("gemm::extent");
    std::printf("%-58s %7d values  %s\n", "gemm::extent", 7, bad ? "WRONG" : "right");
}

// TF32 must actually round: the TF32 result differs from the f32 one for f32 inputs with
// more than 10 mantissa bits.
void check_tf32_differs() {
    const int64_t m = 16, n = 16, k = 64;
    Rng rng{7};
    std::vector<float> A(m * k), B(k * n), C1(m * n), C2(m * n);
    for (auto& x : A) x = (float)rng.uniform();
    for (auto& x : B) x = (float)rng.uniform();
    gemm::Problem pr;
    pr.m = m;
    pr.n = n;
    pr.k = k;
    pr.a = A.data();
    pr.lda = m;
    pr.b = B.data();
    pr.ldb = k;
    pr.c = C1.data();
    pr.ldc = m;
    gemm::run(pr);
    pr.c = C2.data();
    pr.mode = Mode::F32_TF32;
    gemm::run(pr);
    int diff = 0;
    double maxrel = 0;
    for (int64_t i = 0; i < m * n; i++) {
        if (C1[i] != C2[i]) diff++;
        maxrel =
            std::max(maxrel, std::fabs((double)C1[i] - C2[i]) / (std::fabs((double)C1[i]) + 1e-30));
    }
    if (diff < m * n / 2)
        fail("TF32 mode: only " + std::to_string(diff) + " of 256 results differ from f32");
    std::printf("%-58s %7lld values  %d differ from f32 (largest relative difference %.2g)\n",
                "TF32 mode rounds its f32 inputs", (long long)(m * n), diff, maxrel);
}

double time_gemm(Type t, Mode mode, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
    const size_t e = gemm::type_size(t);
    std::vector<uint8_t> A(m * k * e), B(k * n * e), C(m * n * e);
    Rng rng{3};
    for (int64_t i = 0; i < m * k; i++) put(t, A, i, rng.uniform());
    for (int64_t i = 0; i < k * n; i++) put(t, B, i, rng.uniform());
    gemm::Problem pr;
    pr.trans_a = ta;
    pr.trans_b = tb;
    pr.m = m;
    pr.n = n;
    pr.k = k;
    pr.a_type = pr.b_type = pr.c_type = t;
    pr.a = A.data();
    pr.lda = ta ? k : m;
    pr.b = B.data();
    pr.ldb = tb ? n : k;
    pr.c = C.data();
    pr.ldc = m;
    pr.mode = mode;
    double best = 1e30;
    for (int it = 0; it < 3; it++) {
        auto t0 = std::chrono::steady_clock::now();
        gemm::run(pr);
        best = std::min(
            best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return 2.0 * m * n * k / best / 1e9;
}

}  // namespace

int main() {
    check_conversions();
    check_double_to_half();
    check_tf32();
    check_extent();

    // Every transpose combination, non-square, ld > rows, beta != 0, f32.
    const bool tf[2] = {false, true};
    for (bool ta : tf)
        for (bool tb : tf) {
            static std::string names[4];
            std::string& nm = names[ta * 2 + tb];
            nm = std::string("f32 ") + (ta ? "T" : "N") + (tb ? "T" : "N") +
                 " m37 n23 k19, ld+3/5/2, alpha 1.25 beta -0.5";
            Case c;
            c.name = nm.c_str();
            c.ta = ta;
            c.tb = tb;
            c.m = 37;
            c.n = 23;
            c.k = 19;
            c.pad_a = 3;
            c.pad_b = 5;
            c.pad_c = 2;
            c.alpha = 1.25;
            c.beta = -0.5;
            c.seed = 10 + ta * 2 + tb;
            run_case(c);
            static std::string names64[4];
            std::string& n64 = names64[ta * 2 + tb];
            n64 = std::string("f64 ") + (ta ? "T" : "N") + (tb ? "T" : "N") +
                  " m41 n17 k33, ld+1/2/3, alpha -0.75 beta 2";
            c.name = n64.c_str();
            c.m = 41;
            c.n = 17;
            c.k = 33;
            c.pad_a = 1;
            c.pad_b = 2;
            c.pad_c = 3;
            c.a = c.c = Type::F64;
            c.mode = Mode::F64;
            c.alpha = -0.75;
            c.beta = 2;
            run_case(c);
        }

    Case c;
    // beta == 0: C starts NaN and must not show through.
    c = Case{};
    c.name = "f32 NN beta 0, C all NaN";
    c.m = 13, c.n = 9, c.k = 7, c.pad_c = 4, c.nan_c = true;
    run_case(c);
    c.name = "f64 TN beta 0, C all NaN";
    c.ta = true, c.a = c.c = Type::F64, c.mode = Mode::F64;
    run_case(c);
    c = Case{};
    c.name = "f16 -> f16 (COMPUTE_32F) NT beta 0, C all NaN";
    c.tb = true, c.m = 13, c.n = 9, c.k = 7, c.pad_c = 4, c.nan_c = true, c.a = c.c = Type::F16;
    run_case(c);
    c.name = "f16 accumulation beta 0, C all NaN";
    c.mode = Mode::F16;
    run_case(c);
    // k == 0 and alpha == 0: C = beta * C; A (NaN) is not read.
    c = Case{};
    c.name = "f32 k 0: C = beta C";
    c.m = 11, c.n = 5, c.k = 0, c.pad_c = 1, c.beta = 3, c.nan_a = true;
    run_case(c);
    c.name = "f32 alpha 0, A all NaN: C = beta C";
    c.k = 8, c.alpha = 0;
    run_case(c);
    c.name = "bf16 alpha 0 beta 0, C all NaN: C = 0";
    c.a = c.c = Type::BF16, c.beta = 0, c.nan_c = true;
    run_case(c);
    c.name = "f16 accumulation k 0: C = beta C";
    c = Case{};
    c.name = "f16 accumulation k 0: C = beta C";
    c.m = 6, c.n = 7, c.k = 0, c.beta = 0.5, c.a = c.c = Type::F16, c.mode = Mode::F16;
    run_case(c);
    // m == 0 / n == 0: nothing is touched (every element of C is padding).
    c = Case{};
    c.name = "f32 n 0: C untouched";
    c.m = 4, c.n = 0, c.k = 3, c.pad_c = 2, c.beta = 2;
    run_case(c);

    // Strided batches: gaps between matrices, and B shared (stride 0).
    c = Case{};
    c.name = "f32 TN batch 4, strides with gaps, beta 1";
    c.ta = true, c.m = 19, c.n = 14, c.k = 21, c.pad_a = 2, c.pad_c = 1, c.batch = 4, c.gap_a = 7,
    c.gap_b = 3, c.gap_c = 5, c.beta = 1, c.alpha = -1;
    run_case(c);
    c.name = "f32 NT batch 3, B stride 0 (broadcast)";
    c.ta = false, c.tb = true, c.gap_b = -1, c.batch = 3, c.beta = 0;
    run_case(c);
    c.name = "f64 NN batch 5, strides with gaps, beta 0.25";
    c.tb = false, c.gap_b = 2, c.batch = 5, c.a = c.c = Type::F64, c.mode = Mode::F64,
    c.beta = 0.25;
    run_case(c);
    c.name = "bf16 TT batch 3 (COMPUTE_32F), beta -1";
    c.ta = c.tb = true, c.batch = 3, c.a = c.c = Type::BF16, c.mode = Mode::F32, c.beta = -1;
    run_case(c);
    c.name = "f16 NN batch 3 -> f32 C (COMPUTE_32F), beta 0.5";
    c.ta = c.tb = false, c.a = Type::F16, c.c = Type::F32, c.beta = 0.5;
    run_case(c);
    c.name = "f16 TN batch 2, f16 accumulation, beta 0.5";
    c.ta = true, c.batch = 2, c.c = Type::F16, c.mode = Mode::F16;
    run_case(c);

    // 16-bit data with COMPUTE_32F and with the fast compute types (inputs already 16-bit).
    for (Mode md : {Mode::F32, Mode::F32_F16, Mode::F32_BF16, Mode::F32_TF32}) {
        static std::string names[8];
        static int next_name = 0;
        for (Type t : {Type::F16, Type::BF16}) {
            std::string& nm = names[next_name++];
            nm = std::string(gemm::type_name(t)) + " NT m29 n31 k47, mode " + gemm::mode_name(md);
            c = Case{};
            c.name = nm.c_str();
            c.tb = true, c.m = 29, c.n = 31, c.k = 47, c.pad_a = 1, c.pad_b = 1, c.pad_c = 1;
            c.a = c.c = t, c.mode = md, c.alpha = 0.5, c.beta = 0.75;
            run_case(c);
        }
    }
    // f32 data with the fast compute types: inputs rounded to TF32 / f16 / bf16.
    for (Mode md : {Mode::F32_TF32, Mode::F32_F16, Mode::F32_BF16}) {
        static std::string names[3];
        static int next_name = 0;
        std::string& nm = names[next_name++];
        nm = std::string("f32 TT m33 n20 k65, mode ") + gemm::mode_name(md);
        c = Case{};
        c.name = nm.c_str();
        c.ta = c.tb = true, c.m = 33, c.n = 20, c.k = 65, c.pad_b = 3, c.mode = md, c.beta = 1.5;
        run_case(c);
    }
    check_tf32_differs();
    // f16 accumulation, all transposes, k long enough for rounding to matter.
    for (bool ta : tf)
        for (bool tb : tf) {
            static std::string names[4];
            std::string& nm = names[ta * 2 + tb];
            nm = std::string("f16 accumulation ") + (ta ? "T" : "N") + (tb ? "T" : "N") +
                 " m9 n11 k40, beta -0.25";
            c = Case{};
            c.name = nm.c_str();
            c.ta = ta, c.tb = tb, c.m = 9, c.n = 11, c.k = 40, c.pad_a = 2, c.pad_c = 1;
            c.a = c.c = Type::F16, c.mode = Mode::F16, c.alpha = 1.5, c.beta = -0.25;
            run_case(c);
        }
    // Larger than one packing block of A (about 1 MiB): m = 300, k = 1000 in f32.
    c = Case{};
    c.name = "f32 NN m300 n13 k1000 (several A blocks), beta 0.5";
    c.m = 300, c.n = 13, c.k = 1000, c.pad_a = 1, c.beta = 0.5;
    run_case(c);
    c.name = "f64 TT m150 n7 k900 (several A blocks)";
    c.ta = c.tb = true, c.m = 150, c.n = 7, c.k = 900, c.a = c.c = Type::F64, c.mode = Mode::F64;
    run_case(c);

    // Speed: the im2col GEMM of a ResNet 3x3 convolution with 64 channels at 64x128 pixels.
    struct {
        const char* name;
        Type t;
        Mode mode;
        bool ta, tb;
    } speeds[] = {
        {"f32 NN", Type::F32, Mode::F32, false, false},
        {"f32 TN", Type::F32, Mode::F32, true, false},
        {"f32 NT", Type::F32, Mode::F32, false, true},
        {"f32 TF32 NN", Type::F32, Mode::F32_TF32, false, false},
        {"f64 NN", Type::F64, Mode::F64, false, false},
        {"f16 NN (COMPUTE_32F)", Type::F16, Mode::F32, false, false},
        {"bf16 NN (COMPUTE_32F)", Type::BF16, Mode::F32, false, false},
    };
    for (auto& s : speeds) {
        const double g = time_gemm(s.t, s.mode, s.ta, s.tb, 64, 8192, 576);
        std::printf("speed m64 n8192 k576 %-37s %.2f GFLOP/s\n", s.name, g);
        if (s.t == Type::F32 && s.mode == Mode::F32 && g < kMinGflops)
            fail(std::string("speed of ") + s.name);
    }
    const double g16 = time_gemm(Type::F16, Mode::F16, false, false, 64, 512, 576);
    std::printf("speed m64 n512 k576 %-38s %.2f GFLOP/s\n", "f16 accumulation NN", g16);

    std::printf("%s (%d failure%s)\n", failures ? "FAILED" : "ALL PASSED", failures,
                failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
