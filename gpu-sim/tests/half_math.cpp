// Self-check of the simulated GPU's number types and math shims (tests/emu/emu_half.h,
// emu_fp8.h, emu_math.h) against independent references: every result is compared with a
// rounding found by searching the sorted table of all values of the format (no shared code
// with the headers' encoder). Build and run from the repository root:
//   g++ -std=c++17 -O1 -I tests/emu -I gpu-sim/include -include cuda_emu.h
//       gpu-sim/tests/half_math.cpp -o /tmp/half_math && /tmp/half_math
// Prints each failure (the first few per check) and exits non-zero if there was any.
#include <cuda/std/limits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

// The atomics' preemption point (tests/emu/emu.cpp): these tests call atomics outside any
// launch, where it does nothing.
void emu::preempt() {}

namespace {

int failures = 0;
int reported = 0;
void fail(const char* what, double in, unsigned got, unsigned want) {
    ++failures;
    if (++reported <= 40) std::printf("FAIL %s: input %.17g got 0x%x want 0x%x\n", what, in, got, want);
}
void check(bool ok, const char* what) {
    if (!ok) {
        ++failures;
        std::printf("FAIL %s\n", what);
    }
}

// ---------------------------------------------------------------- reference formats
// A format described only by its bit layout; values are computed here from the definition.
struct Ref {
    int ebits, mbits;
    bool ieee;  // all-ones exponent is inf/NaN (else, E4M3: only S.1111.111 is NaN, no inf)
    std::vector<std::pair<long double, unsigned>> finite;  // non-negative finite, ascending
    std::vector<long double> by_bits;                      // magnitude bits -> value (inf too)
    long double max, overflow_at;                          // largest finite; first value to inf

    Ref(int e, int m, bool i) : ebits(e), mbits(m), ieee(i) {
        const int bias = (1 << (e - 1)) - 1;
        for (unsigned b = 0; b < (1u << (e + m)); ++b) {
            const unsigned E = b >> m, M = b & ((1u << m) - 1);
            if (ieee && E == (1u << e) - 1) continue;
            if (!ieee && b == (1u << (e + m)) - 1) continue;
            const long double v = E == 0 ? std::ldexp((long double)M, 1 - bias - m)
                                         : std::ldexp((long double)((1u << m) + M), (int)E - bias - m);
            finite.push_back({v, b});
        }
        by_bits.assign(1u << (e + m), 0.0L);
        for (auto& p : finite) by_bits[p.second] = p.first;
        if (ieee) by_bits[inf_bits()] = HUGE_VALL;
        max = finite.back().first;
        const long double ulp = max - finite[finite.size() - 2].first;
        overflow_at = max + ulp / 2;  // a tie there rounds away from the odd largest value
    }
    unsigned sign_bit() const { return 1u << (ebits + mbits); }
    unsigned inf_bits() const { return ((1u << ebits) - 1) << mbits; }
    bool is_nan(unsigned b) const {
        const unsigned mag = b & (sign_bit() - 1);
        return ieee ? mag > inf_bits() : mag == sign_bit() - 1;
    }
    // Round to nearest, ties to the even encoding. Beyond range: inf, or `sat_bits` if given.
    unsigned round(long double x, long sat_bits = -1) const {
        const unsigned sign = std::signbit(x) ? sign_bit() : 0;
        const long double a = std::fabs(x);
        if (a >= overflow_at) return sign | (sat_bits >= 0 ? (unsigned)sat_bits : inf_bits());
        auto hi = std::lower_bound(finite.begin(), finite.end(), std::make_pair(a, 0u),
                                   [](const auto& p, const auto& q) { return p.first < q.first; });
        if (hi == finite.end()) return sign | finite.back().second;
        if (hi->first == a || hi == finite.begin()) return sign | hi->second;
        auto lo = hi - 1;
        const long double dl = a - lo->first, dh = hi->first - a;
        if (dl < dh) return sign | lo->second;
        if (dh < dl) return sign | hi->second;
        return sign | ((lo->second & 1) ? hi->second : lo->second);
    }
    long double value(unsigned b) const {  // of a non-NaN encoding
        const long double v = by_bits[b & (sign_bit() - 1)];
        return (b & sign_bit()) ? -v : v;
    }
};

const Ref kHalf(5, 10, true), kBf16(8, 7, true), kE4M3(4, 3, false), kE5M2(5, 2, true);

// A conversion result against the reference: NaN must give the canonical NaN 0x7fff.
void expect16(const Ref& ref, const char* what, long double x, unsigned got) {
    const unsigned want = std::isnan(x) ? 0x7fffu : ref.round(x);
    if (got != want) fail(what, (double)x, got, want);
}

// Floats around every tie of the format, the extremes and special values.
std::vector<float> interesting_floats(const Ref& ref) {
    std::vector<float> v = {0.0f, -0.0f, HUGE_VALF, -HUGE_VALF, NAN, -NAN, 1e-45f, 3e38f, -3e38f};
    for (size_t i = 0; i + 1 < ref.finite.size(); ++i) {
        const float lo = (float)ref.finite[i].first, hi = (float)ref.finite[i + 1].first;
        const float mid = (float)((ref.finite[i].first + ref.finite[i + 1].first) / 2);
        for (float f : {lo, hi, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, HUGE_VALF)}) {
            v.push_back(f);
            v.push_back(-f);
        }
    }
    const float top = (float)ref.overflow_at;
    for (float f : {top, std::nextafter(top, 0.0f), std::nextafter(top, HUGE_VALF)}) v.push_back(f);
    return v;
}

void check_conversions() {
    std::vector<float> floats = interesting_floats(kHalf), bf = interesting_floats(kBf16);
    floats.insert(floats.end(), bf.begin(), bf.end());
    for (uint32_t b = 0; b < 0xffffffffu - 4093; b += 4093) {  // a sweep of all float patterns
        float f;
        std::memcpy(&f, &b, 4);
        floats.push_back(f);
    }
    for (float f : floats) {
        expect16(kHalf, "__float2half", f, __half_as_ushort(__float2half(f)));
        expect16(kHalf, "__half(float)", f, __half_as_ushort(__half(f)));
        expect16(kBf16, "__float2bfloat16", f, __bfloat16_as_ushort(__float2bfloat16(f)));
        expect16(kBf16, "__float2bfloat16_rn", f, __bfloat16_as_ushort(__float2bfloat16_rn(f)));
    }
    // double -> 16 bits rounds once: a tie nudged by less than a float ulp must not become a tie.
    for (const Ref* ref : {&kHalf, &kBf16}) {
        for (size_t i = 0; i + 1 < ref->finite.size(); i += 7) {
            const long double mid = (ref->finite[i].first + ref->finite[i + 1].first) / 2;
            for (double d : {(double)mid * (1 + 1e-12), (double)mid * (1 - 1e-12), (double)mid}) {
                if (ref == &kHalf) expect16(kHalf, "__double2half", d, __half_as_ushort(__double2half(d)));
                if (ref == &kBf16)
                    expect16(kBf16, "__double2bfloat16", d, __bfloat16_as_ushort(__double2bfloat16(d)));
            }
        }
    }
    // Every 16-bit pattern widens exactly.
    for (unsigned b = 0; b < 0x10000; ++b) {
        const float h = __half2float(__ushort_as_half((unsigned short)b));
        const float r = __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
        if (kHalf.is_nan(b) ? !std::isnan(h) : (long double)h != kHalf.value(b)) fail("__half2float", b, 0, 0);
        if (kBf16.is_nan(b) ? !std::isnan(r) : (long double)r != kBf16.value(b)) fail("__bfloat162float", b, 0, 0);
    }
    // Integer sources round once (64-bit ones too, where a double would round first).
    for (long long v : {0LL, 1LL, -3LL, 2049LL, 2051LL, 65519LL, 65520LL, 70000LL, -70000LL, 16777217LL,
                        (1LL << 60) + (1LL << 52) + 1, -((1LL << 60) + (1LL << 52) + 1), (1LL << 62) + 1}) {
        expect16(kHalf, "__half(long long)", (long double)v, __half_as_ushort(__half(v)));
        expect16(kBf16, "__nv_bfloat16(long long)", (long double)v, __bfloat16_as_ushort(__nv_bfloat16(v)));
        const unsigned long long u = (unsigned long long)v;
        expect16(kBf16, "__ull2bfloat16_rn", (long double)u, __bfloat16_as_ushort(__ull2bfloat16_rn(u)));
        if (v == (int)v) expect16(kHalf, "__int2half_rn", v, __half_as_ushort(__int2half_rn((int)v)));
    }
    __half one = 1.0;  // copy-initialisation from double, as candle writes it
    __nv_bfloat16 zero = 0.;
    check(__half_as_ushort(one) == 0x3c00 && __bfloat16_as_ushort(zero) == 0, "__half h = 1.0");
    // To integers: toward zero, saturating, NaN -> 0.
    check(__half2int_rz(__float2half(-2.75f)) == -2, "__half2int_rz(-2.75)");
    check(__half2int_rz(__float2half(NAN)) == 0, "__half2int_rz(NaN)");
    check(__half2int_rz(__float2half(HUGE_VALF)) == INT_MAX, "__half2int_rz(inf)");
    check(__half2uint_rz(__float2half(-5.0f)) == 0, "__half2uint_rz(-5)");
    check(__bfloat162int_rz(__float2bfloat16(-1e30f)) == INT_MIN, "__bfloat162int_rz(-1e30)");
    check((unsigned)__half(__float2half(300.5f)) == 300, "(unsigned)__half");
    check((unsigned char)__half(__float2half(300.0f)) == 255, "(unsigned char)__half saturates");
    check(!(bool)__half(__float2half(-0.0f)) && (bool)__half(__float2half(NAN)), "bool(__half)");
}

// ---------------------------------------------------------------- arithmetic
template <typename T> unsigned bits_of(T v) { return v.__x; }

// Binary16 rounding of the exact value s·2^-48 (s a 128-bit integer), by the same nearest/even
// search over the table in integer arithmetic. Zero results take the sign of s (+0 when s = 0).
unsigned round_half_scaled(const Ref& ref, __int128 s) {
    const unsigned sign = s < 0 ? ref.sign_bit() : 0;
    const __int128 a = s < 0 ? -s : s;
    auto scaled = [](long double v) { return (__int128)std::ldexp(v, 48); };  // exact: v·2^24 < 2^40
    if (2 * a >= scaled(ref.max) + scaled(ref.max + ref.max - ref.finite[ref.finite.size() - 2].first))
        return sign | ref.inf_bits();
    size_t lo = 0, hi = ref.finite.size() - 1;  // finite[lo] <= a < finite[hi] after the search
    while (hi - lo > 1) {
        const size_t mid = (lo + hi) / 2;
        (scaled(ref.finite[mid].first) <= a ? lo : hi) = mid;
    }
    if (scaled(ref.finite[hi].first) <= a) lo = hi;
    const __int128 dl = a - scaled(ref.finite[lo].first), dh = scaled(ref.finite[hi].first) - a;
    if (lo == hi || dl < dh) return sign | ref.finite[lo].second;
    if (dh < dl) return sign | ref.finite[hi].second;
    return sign | ((ref.finite[lo].second & 1) ? ref.finite[hi].second : ref.finite[lo].second);
}

template <typename T> void check_arith(const Ref& ref, const char* name, std::mt19937& rng) {
    auto pick = [&]() {
        // mostly finite values of all magnitudes, sometimes specials
        const unsigned r = rng() % 64;
        unsigned b = rng() & 0xffff;
        if (r == 0) b = ref.inf_bits() | (rng() & 1 ? ref.sign_bit() : 0);
        if (r == 1) b = rng() & 0x8000;  // +-0
        if (r == 2) b = 0x7fff;
        return T(typename T::Raw{(unsigned short)b});
    };
    char what[64];
    for (int i = 0; i < 400000; ++i) {
        const T a = pick(), b = pick();
        const long double x = ref.value(bits_of(a)), y = ref.value(bits_of(b));
        const bool nan_in = ref.is_nan(bits_of(a)) || ref.is_nan(bits_of(b));
        const long double sums[4] = {x + y, x - y, x * y, x / y};
        const T got[4] = {a + b, a - b, a * b, a / b};
        static const char* ops = "+-*/";
        for (int k = 0; k < 4; ++k) {
            std::snprintf(what, sizeof what, "%s %c", name, ops[k]);
            const long double r = nan_in ? NAN : sums[k];
            const unsigned want = std::isnan(r) ? 0x7fffu : ref.round(r);
            if (bits_of(got[k]) != want) fail(what, (double)x, bits_of(got[k]), want);
        }
        // compound assignment and the intrinsics agree with the operators
        T c = a;
        c += b;
        if (bits_of(c) != bits_of(got[0]) || bits_of(__hadd(a, b)) != bits_of(got[0]) ||
            bits_of(__hdiv(a, b)) != bits_of(got[3]))
            fail("compound/intrinsic", (double)x, bits_of(c), bits_of(got[0]));
        // comparisons: IEEE, NaN unordered
        const bool cmp_ok = (a == b) == (x == y && !nan_in) && (a != b) == (nan_in || x != y) &&
                            (a < b) == (!nan_in && x < y) && (a <= b) == (!nan_in && x <= y) &&
                            (a > b) == (!nan_in && x > y) && (a >= b) == (!nan_in && x >= y);
        if (!cmp_ok) fail("comparison", (double)x, bits_of(a), bits_of(b));
        // square root (correctly rounded)
        if (!ref.is_nan(bits_of(a))) {
            const long double sq = std::sqrt(x);
            const unsigned want_s = std::isnan(sq) ? 0x7fffu : ref.round(sq);
            if (bits_of(hsqrt(a)) != want_s) fail("hsqrt", (double)x, bits_of(hsqrt(a)), want_s);
        }
        // fma (half only): one rounding of the exact a*b+c, which as a multiple of 2^-48 fits in
        // 128 bits; compared with the nearest multiples of the table's values the same way.
        if (std::is_same<T, __half>::value && !nan_in && std::isfinite(x) && std::isfinite(y)) {
            const T c = pick();
            const long double z = ref.value(bits_of(c));
            if (ref.is_nan(bits_of(c)) || !std::isfinite(z)) continue;
            const __int128 exact = (__int128)std::ldexp(x, 24) * (__int128)std::ldexp(y, 24) +
                                   ((__int128)std::ldexp(z, 24) << 24);
            unsigned want_f = round_half_scaled(ref, exact);
            if (exact == 0 && std::signbit(x * y) && std::signbit(z)) want_f = 0x8000;  // -0 + -0
            const unsigned got_f = bits_of(__hfma(a, b, c));
            if (got_f != want_f) fail("__hfma", (double)x, got_f, want_f);
        }
    }
}

template <typename T> void check_minmax(const char* name) {
    const T nan = T(typename T::Raw{0x7fc1})  /* a NaN in both formats */, one = T(1), two = T(2), pz = T(0.0f), nz = T(-0.0f);
    bool ok = bits_of(__hmax(nan, one)) == bits_of(one) && bits_of(__hmax(one, nan)) == bits_of(one) &&
              bits_of(__hmin(nan, two)) == bits_of(two) && bits_of(__hmax(nan, nan)) == 0x7fff &&
              bits_of(__hmax_nan(one, nan)) == 0x7fff && bits_of(__hmin_nan(nan, two)) == 0x7fff &&
              bits_of(__hmax(one, two)) == bits_of(two) && bits_of(__hmin(one, two)) == bits_of(one) &&
              bits_of(__hmax(nz, pz)) == bits_of(pz) && bits_of(__hmax(pz, nz)) == bits_of(pz) &&
              bits_of(__hmin(pz, nz)) == bits_of(nz) && bits_of(__hmax_nan(one, two)) == bits_of(two) &&
              __hisnan(nan) && !__hisnan(one) && __hisinf(T(-HUGE_VALF)) == -1 && __hisinf(T(HUGE_VALF)) == 1 &&
              __hisinf(one) == 0 && bits_of(__habs(T(-2.0f))) == bits_of(two) &&
              bits_of(__hneg(one)) == (bits_of(one) | 0x8000) && bits_of(-pz) == 0x8000;
    char what[64];
    std::snprintf(what, sizeof what, "%s max/min/isnan/isinf/abs/neg", name);
    check(ok, what);
}

// ---------------------------------------------------------------- fp8
void check_fp8() {
    struct Known {
        float in;
        unsigned char want;
    } known[] = {{448.0f, 0x7e},  {0.0625f, 0x18}, {1000.0f, 0x7e}, {-1000.0f, 0xfe}, {464.0f, 0x7e},
                 {1.0f, 0x38},    {-2.0f, 0xc0},   {0.001953125f, 0x01}, {0.0009765625f, 0x00},
                 {HUGE_VALF, 0x7e}, {-HUGE_VALF, 0xfe}, {NAN, 0x7f}};
    for (auto k : known) {
        const unsigned got = __nv_fp8_e4m3(k.in).__x;
        if (got != k.want) fail("__nv_fp8_e4m3(float)", k.in, got, k.want);
    }
    // all halves into e4m3 and e5m2 (saturating) against the reference; every code back to half
    for (unsigned b = 0; b < 0x10000; ++b) {
        const __half h = __ushort_as_half((unsigned short)b);
        if (kHalf.is_nan(b)) {
            check(kE4M3.is_nan(__nv_fp8_e4m3(h).__x) && kE5M2.is_nan(__nv_fp8_e5m2(h).__x), "fp8(NaN half)");
            continue;
        }
        const long double x = kHalf.value(b);
        const unsigned w4 = kE4M3.round(x, 0x7e), w5 = kE5M2.round(x, 0x7b);
        if (__nv_fp8_e4m3(h).__x != w4) fail("__nv_fp8_e4m3(__half)", (double)x, __nv_fp8_e4m3(h).__x, w4);
        if (__nv_fp8_e5m2(h).__x != w5) fail("__nv_fp8_e5m2(__half)", (double)x, __nv_fp8_e5m2(h).__x, w5);
        if (__nv_fp8_e4m3((float)x).__x != w4) fail("__nv_fp8_e4m3(float)", (double)x, __nv_fp8_e4m3((float)x).__x, w4);
        if (__nv_fp8_e4m3((double)x).__x != w4) fail("__nv_fp8_e4m3(double)", (double)x, 0, w4);
    }
    for (unsigned c = 0; c < 256; ++c) {
        const float f = __half2float(__nv_cvt_fp8_to_halfraw((unsigned char)c, __NV_E4M3));
        const float g = __half2float(__nv_cvt_fp8_to_halfraw((unsigned char)c, __NV_E5M2));
        if (kE4M3.is_nan(c) ? !std::isnan(f) : (long double)f != kE4M3.value(c)) fail("e4m3 -> half", c, 0, 0);
        if (kE5M2.is_nan(c) ? !std::isnan(g) : (long double)g != kE5M2.value(c)) fail("e5m2 -> half", c, 0, 0);
        __nv_fp8_e4m3 v;
        v.__x = (unsigned char)c;
        if (!kE4M3.is_nan(c) && (long double)(float)v != kE4M3.value(c)) fail("(float)__nv_fp8_e4m3", c, 0, 0);
    }
    check(__nv_cvt_float_to_fp8(1000.0f, __NV_NOSAT, __NV_E4M3) == 0x7f, "e4m3 no-sat overflow is NaN");
    check(__nv_cvt_float_to_fp8(1e6f, __NV_NOSAT, __NV_E5M2) == 0x7c, "e5m2 no-sat overflow is inf");
    check(__nv_fp8_e4m3(3).__x == 0x44 && (int)__nv_fp8_e4m3(-3.7f) == -3, "fp8 integers");
}

// ---------------------------------------------------------------- atomics, math, limits
void check_atomics() {
    float f = 1.0f;
    check(atomicAdd(&f, 0.5f) == 1.0f && f == 1.5f, "atomicAdd(float)");
    float tiny = 0.0f;
    atomicAdd(&tiny, 1e-40f);  // atom.add.f32 flushes subnormals
    check(tiny == 0.0f, "atomicAdd(float) flushes subnormals");
    double d = 1.0;
    check(atomicAdd(&d, 1e-300) == 1.0 && d == 1.0 + 1e-300, "atomicAdd(double)");
    __half h = __float2half(2048.0f);
    check(__half2float(atomicAdd(&h, __float2half(1.0f))) == 2048.0f && __half2float(h) == 2048.0f,
          "atomicAdd(__half) rounds to even");
    __nv_bfloat16 b = __float2bfloat16(1.0f);
    atomicAdd(&b, __float2bfloat16(1.0f));
    check(__bfloat162float(b) == 2.0f, "atomicAdd(__nv_bfloat16)");
    // four OS threads adding concurrently lose nothing
    float fs = 0.0f;
    __half hs = __float2half(0.0f);
    unsigned us = 0;
    unsigned long long ull = 0;
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t)
        ts.emplace_back([&] {
            for (int i = 0; i < 250; ++i) {
                atomicAdd(&fs, 1.0f);
                atomicAdd(&hs, __float2half(1.0f));
                atomicAdd(&us, 1u);
                atomicAdd(&ull, 2ull);
            }
        });
    for (auto& t : ts) t.join();
    check(fs == 1000.0f && __half2float(hs) == 1000.0f && us == 1000 && ull == 2000, "concurrent atomicAdd");
    int m = 5;
    check(atomicMax(&m, 9) == 5 && m == 9 && atomicMin(&m, -1) == 9 && m == -1, "atomicMax/Min(int)");
    unsigned short s = 7;
    check(atomicCAS(&s, (unsigned short)7, (unsigned short)8) == 7 && s == 8, "atomicCAS(ushort) swap");
    check(atomicCAS(&s, (unsigned short)7, (unsigned short)9) == 8 && s == 8, "atomicCAS(ushort) no swap");
    unsigned w = 3;
    check(atomicInc(&w, 3) == 3 && w == 0 && atomicDec(&w, 5) == 0 && w == 5, "atomicInc/Dec");
    long long ll = -4;
    check(atomicMax(&ll, 3LL) == -4 && ll == 3, "atomicMax(long long)");
}

void check_math() {
    check(normcdff(0.0f) == 0.5f && std::fabs(normcdff(1.959964f) - 0.975f) < 1e-6f, "normcdff");
    check(normcdf(0.0) == 0.5 && normcdf(-30.0) > 0.0 && normcdf(-30.0) < 1e-196, "normcdf");
    check(__float_as_uint(1.0f) == 0x3f800000u && __uint_as_float(0x40000000u) == 2.0f &&
              __int_as_float(__float_as_int(-3.5f)) == -3.5f &&
              __longlong_as_double(__double_as_longlong(0.1)) == 0.1,
          "bit casts");
    check(__saturatef(NAN) == 0.0f && __saturatef(2.0f) == 1.0f && __saturatef(0.25f) == 0.25f, "__saturatef");
    // CUDA's min/max: signed with unsigned of one width is unsigned
    static_assert(std::is_same<decltype(min(1, 2u)), unsigned>::value, "min(int, unsigned)");
    static_assert(std::is_same<decltype(max(1L, 2UL)), unsigned long>::value, "max(long, unsigned long)");
    static_assert(std::is_same<decltype(min(1.0f, 2.0)), double>::value, "min(float, double)");
    check(min(-1, 5u) == 5u && max(-3, -7) == -3 && min(size_t(3), size_t(9)) == 3, "integer min/max");
    check(max(NAN, 1.0f) == 1.0f && min(2.0, NAN) == 2.0, "float min/max ignore NaN");
    check(isnan(NAN) && isinf(-HUGE_VALF) && signbit(-0.0f) && !signbit(0.0), "isnan/isinf/signbit");
    // vector types
    static_assert(alignof(float4) == 16 && sizeof(float2) == 8 && alignof(__nv_bfloat162) == 4, "vectors");
    const __nv_bfloat162 p = __hadd2(__nv_bfloat162{__nv_bfloat16(1), __nv_bfloat16(2)},
                                     __nv_bfloat162{__nv_bfloat16(0.5f), __nv_bfloat16(0.25f)});
    check(__bfloat162float(p.x) == 1.5f && __bfloat162float(p.y) == 2.25f, "__hadd2(bf16)");
    // limits
    using LH = cuda::std::numeric_limits<__half>;
    using LB = cuda::std::numeric_limits<__nv_bfloat16>;
    check(__half2float(LH::max()) == 65504.0f && __half2float(LH::lowest()) == -65504.0f &&
              std::isinf(__half2float(LH::infinity())) && __hisnan(LH::quiet_NaN()) &&
              __half2float(LH::min()) == 0x1p-14f && __half2float(LH::epsilon()) == 0x1p-10f &&
              __half2float(LH::denorm_min()) == 0x1p-24f,
          "numeric_limits<__half>");
    check(__bfloat162float(LB::max()) == 0x1.fep127f && __bfloat162float(LB::lowest()) == -0x1.fep127f &&
              __bfloat162float(LB::epsilon()) == 0x1p-7f && __bfloat162float(LB::min()) == 0x1p-126f,
          "numeric_limits<__nv_bfloat16>");
    check(cuda::std::numeric_limits<long>::lowest() == LONG_MIN, "numeric_limits<int64_t>");
}

}  // namespace

int main() {
    std::mt19937 rng(20240607);
    check_conversions();
    check_arith<__half>(kHalf, "half", rng);
    check_arith<__nv_bfloat16>(kBf16, "bf16", rng);
    check_minmax<__half>("half");
    check_minmax<__nv_bfloat16>("bf16");
    check_fp8();
    check_atomics();
    check_math();
    if (failures) {
        std::printf("%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("half_math: all checks passed\n");
    return 0;
}
