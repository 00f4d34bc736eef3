// XORWOW (G. Marsaglia, "Xorshift RNGs", J. Stat. Softw. 8(14), 2003) for the simulated
// cuRAND (curand.cpp), with jump-ahead and the conversions to cuRAND's distributions; callable
// without the driver (gpu-sim/tests/rand_ref.cpp). Not bit-identical to NVIDIA's cuRAND.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace xorwow {

struct Xorwow {
    uint32_t x[5];
    uint32_t d;
};

inline uint32_t next(Xorwow& s) {
    const uint32_t t = s.x[0] ^ (s.x[0] >> 2);
    s.x[0] = s.x[1];
    s.x[1] = s.x[2];
    s.x[2] = s.x[3];
    s.x[3] = s.x[4];
    s.x[4] = (s.x[4] ^ (s.x[4] << 4)) ^ (t ^ (t << 1));
    s.d += 362437u;
    return s.x[4] + s.d;
}

// The xorshift part is linear over GF(2) on its 160 bits: x' = M x. Bits 0..31 are x[0], ...
using Bits = std::array<uint64_t, 3>;

inline Bits to_bits(const uint32_t x[5]) {
    return Bits{(uint64_t)x[0] | (uint64_t)x[1] << 32, (uint64_t)x[2] | (uint64_t)x[3] << 32,
                (uint64_t)x[4]};
}
inline void from_bits(const Bits& b, uint32_t x[5]) {
    x[0] = (uint32_t)b[0];
    x[1] = (uint32_t)(b[0] >> 32);
    x[2] = (uint32_t)b[1];
    x[3] = (uint32_t)(b[1] >> 32);
    x[4] = (uint32_t)b[2];
}

// A 160 x 160 matrix as its columns.
using Matrix = std::vector<Bits>;

inline Bits mat_apply(const Matrix& m, const Bits& v) {
    Bits r{0, 0, 0};
    for (int j = 0; j < 160; j++)
        if ((v[j >> 6] >> (j & 63)) & 1) {
            r[0] ^= m[j][0];
            r[1] ^= m[j][1];
            r[2] ^= m[j][2];
        }
    return r;
}

// M^(2^i) for i = 0 .. 63, built once.
inline const std::vector<Matrix>& jump_table() {
    static const std::vector<Matrix> table = [] {
        std::vector<Matrix> t(64, Matrix(160));
        for (int j = 0; j < 160; j++) {
            Bits e{0, 0, 0};
            e[j >> 6] = (uint64_t)1 << (j & 63);
            Xorwow s{};
            from_bits(e, s.x);
            next(s);
            t[0][j] = to_bits(s.x);
        }
        for (int i = 1; i < 64; i++)
            for (int j = 0; j < 160; j++) t[i][j] = mat_apply(t[i - 1], t[i - 1][j]);
        return t;
    }();
    return table;
}

// The state n draws later.
inline Xorwow jump(Xorwow s, uint64_t n) {
    if (n == 0) return s;
    const auto& t = jump_table();
    Bits v = to_bits(s.x);
    for (int i = 0; i < 64; i++)
        if ((n >> i) & 1) v = mat_apply(t[i], v);
    from_bits(v, s.x);
    s.d += (uint32_t)(362437u * (uint32_t)n);  // the Weyl counter, modulo 2^32
    return s;
}

// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
// OOPSLA 2014): spreads the seed's bits over the state.
inline uint64_t splitmix64(uint64_t& z) {
    uint64_t r = (z += 0x9e3779b97f4a7c15ull);
    r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
    r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
    return r ^ (r >> 31);
}

// The state at position 0 for `seed`: Marsaglia's initial values xor-ed with the seed's mix.
inline Xorwow seeded(uint64_t seed) {
    uint64_t z = seed;
    const uint64_t w0 = splitmix64(z), w1 = splitmix64(z), w2 = splitmix64(z);
    Xorwow s;
    s.x[0] = 123456789u ^ (uint32_t)w0;
    s.x[1] = 362436069u ^ (uint32_t)(w0 >> 32);
    s.x[2] = 521288629u ^ (uint32_t)w1;
    s.x[3] = 88675123u ^ (uint32_t)(w1 >> 32);
    s.x[4] = 5783321u ^ (uint32_t)w2;
    s.d = 6615241u ^ (uint32_t)(w2 >> 32);
    if ((s.x[0] | s.x[1] | s.x[2] | s.x[3] | s.x[4]) == 0) s.x[0] = 123456789u;  // never all zero
    return s;
}

// The uniforms in (0, 1]: 24 bits of one draw for float, 53 bits of two draws for double.
// Both are exact in their type; 0 is impossible and 1 possible (cuRAND's range).
inline double uniform_f(uint32_t a) {
    return (double)((a >> 8) + 1) * 0x1p-24;
}
inline double uniform_d(uint32_t a, uint32_t b) {
    return (double)((((uint64_t)a << 21) | (b >> 11)) + 1) * 0x1p-53;
}

// Box-Muller: two uniforms in (0, 1] to two independent standard normals (u1 > 0, so the log
// is finite).
inline void box_muller(double u1, double u2, double* z0, double* z1) {
    const double two_pi = 6.283185307179586476925286766559;
    const double r = std::sqrt(-2.0 * std::log(u1)), th = two_pi * u2;
    *z0 = r * std::cos(th);
    *z1 = r * std::sin(th);
}

}  // namespace xorwow
