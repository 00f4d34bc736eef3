// Check of the simulated cuRAND's generator core (gpu-sim/src/xorwow.h), without the driver:
// XORWOW's step against the recurrence as Marsaglia's paper states it, the jump-ahead against
// stepping, the uniform conversions' ranges ((0, 1], as cuRAND documents), and the moments of
// the uniform and Box-Muller normal values (named tolerances: several standard errors).
//
// Build and run from the repository root:
//   g++ -std=c++17 -O2 -Wall -Werror -I gpu-sim/src gpu-sim/tests/rand_ref.cpp -o /tmp/rand_ref
//   /tmp/rand_ref
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "xorwow.h"

namespace {

// Moments of N samples must lie within this many standard errors of the true ones.
constexpr double kSigmas = 6.0;
constexpr int kSamples = 1 << 20;

int failures = 0;
void check(bool ok, const std::string& what) {
    std::printf("%-70s %s\n", what.c_str(), ok ? "ok" : "FAIL");
    if (!ok) failures++;
}

}  // namespace

int main() {
    // The paper's recurrence, with its named variables.
    {
        xorwow::Xorwow s = xorwow::seeded(42);
        uint32_t x = s.x[0], y = s.x[1], z = s.x[2], w = s.x[3], v = s.x[4], d = s.d;
        bool same = true;
        for (int i = 0; i < 1000; i++) {
            uint32_t t = x ^ (x >> 2);
            x = y;
            y = z;
            z = w;
            w = v;
            v = (v ^ (v << 4)) ^ (t ^ (t << 1));
            const uint32_t want = (d += 362437) + v;
            same &= xorwow::next(s) == want;
        }
        check(same, "next() follows xorwow's recurrence for 1000 draws");
    }
    // Jump-ahead equals stepping, for several distances, and composes.
    {
        bool same = true;
        for (uint64_t n : {1ull, 2ull, 3ull, 63ull, 64ull, 1000ull, 123457ull}) {
            xorwow::Xorwow a = xorwow::seeded(7), b = a;
            for (uint64_t i = 0; i < n; i++) xorwow::next(a);
            b = xorwow::jump(b, n);
            same &= std::equal(a.x, a.x + 5, b.x) && a.d == b.d;
        }
        xorwow::Xorwow a = xorwow::jump(xorwow::jump(xorwow::seeded(9), 1ull << 40), 12345),
                       b = xorwow::jump(xorwow::jump(xorwow::seeded(9), 12345), 1ull << 40);
        same &= std::equal(a.x, a.x + 5, b.x) && a.d == b.d;
        check(same, "jump(n) equals n steps (n up to 123457) and jumps commute (2^40)");
    }
    // Seeds give different sequences; a seed gives the same one.
    {
        xorwow::Xorwow a = xorwow::seeded(0), b = xorwow::seeded(1), c = xorwow::seeded(0);
        int equal01 = 0;
        bool repeat = true;
        for (int i = 0; i < 100; i++) {
            uint32_t va = xorwow::next(a), vb = xorwow::next(b), vc = xorwow::next(c);
            equal01 += va == vb;
            repeat &= va == vc;
        }
        check(repeat && equal01 == 0, "seed 0 repeats itself and differs from seed 1");
    }
    // Uniform ranges at the extremes of the draws.
    {
        bool ok = xorwow::uniform_f(0) > 0 && xorwow::uniform_f(0xffffffffu) == 1.0 &&
                  (float)xorwow::uniform_f(0x12345678u) == xorwow::uniform_f(0x12345678u) &&
                  xorwow::uniform_d(0, 0) > 0 &&
                  xorwow::uniform_d(0xffffffffu, 0xffffffffu) == 1.0 &&
                  xorwow::uniform_d(0, 0) == 0x1p-53;
        check(ok, "uniforms: smallest > 0, largest == 1, float values exact in float");
    }
    // Moments.
    {
        xorwow::Xorwow s = xorwow::seeded(299792458);
        double sum = 0, sum2 = 0, lo = 2, hi = -1;
        for (int i = 0; i < kSamples; i++) {
            const double u = xorwow::uniform_f(xorwow::next(s));
            sum += u;
            sum2 += u * u;
            lo = std::min(lo, u);
            hi = std::max(hi, u);
        }
        const double mean = sum / kSamples, var = sum2 / kSamples - mean * mean;
        const double se_mean = std::sqrt(1.0 / 12 / kSamples);
        check(lo > 0 && hi <= 1 && std::fabs(mean - 0.5) < kSigmas * se_mean &&
                  std::fabs(var - 1.0 / 12) < kSigmas * std::sqrt(1.0 / 180 / kSamples),
              "uniform float: in (0, 1], mean 1/2 and variance 1/12 within 6 standard errors");
        double n1 = 0, n2 = 0, n3 = 0, n4 = 0;
        for (int i = 0; i < kSamples; i += 2) {
            const double u1 = xorwow::uniform_d(xorwow::next(s), xorwow::next(s));
            const double u2 = xorwow::uniform_d(xorwow::next(s), xorwow::next(s));
            double z[2];
            xorwow::box_muller(u1, u2, &z[0], &z[1]);
            for (double v : z) {
                n1 += v;
                n2 += v * v;
                n3 += v * v * v;
                n4 += v * v * v * v;
            }
        }
        n1 /= kSamples;
        n2 /= kSamples;
        n3 /= kSamples;
        n4 /= kSamples;
        const double se = 1 / std::sqrt((double)kSamples);
        check(
            std::fabs(n1) < kSigmas * se && std::fabs(n2 - 1) < kSigmas * std::sqrt(2.0) * se &&
                std::fabs(n3) < kSigmas * std::sqrt(15.0) * se &&
                std::fabs(n4 - 3) < kSigmas * std::sqrt(96.0) * se,
            "normal (Box-Muller on 53-bit uniforms): moments 0, 1, 0, 3 within 6 standard errors");
    }
    std::printf("%s (%d failure%s)\n", failures ? "FAILED" : "ALL PASSED", failures,
                failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
