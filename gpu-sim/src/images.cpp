// Reading the entry points of a module image: PTX text (`.entry name(.param ...)`) or a fatbin
// (the ELF cubins it holds: global FUNC symbols, and each kernel's EIATTR_KPARAM_INFO records
// in `.nv.info.<name>`). Only names and parameter sizes are read; the code that runs is the
// g++ build of the same sources.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "images.h"

namespace sim {

namespace {

unsigned ptx_type_size(const std::string& t) {
    if (t == ".u64" || t == ".s64" || t == ".b64" || t == ".f64") return 8;
    if (t == ".u32" || t == ".s32" || t == ".b32" || t == ".f32") return 4;
    if (t == ".u16" || t == ".s16" || t == ".b16" || t == ".f16") return 2;
    if (t == ".u8" || t == ".s8" || t == ".b8") return 1;
    return 0;
}

// One `.param` declaration: `.param .u64 .ptr .align 1 name` or `.param .align 2 .b8 name[2]`.
bool parse_param(const std::string& decl, unsigned& size) {
    std::vector<std::string> tok;
    size_t i = 0;
    while (i < decl.size()) {
        while (i < decl.size() && (isspace((unsigned char)decl[i]) || decl[i] == ',')) i++;
        size_t j = i;
        while (j < decl.size() && !isspace((unsigned char)decl[j]) && decl[j] != ',') j++;
        if (j > i) tok.push_back(decl.substr(i, j - i));
        i = j;
    }
    unsigned elem = 0;
    for (const auto& t : tok)
        if (unsigned s = ptx_type_size(t)) elem = s;
    if (!elem || tok.empty()) return false;
    const std::string& last = tok.back();
    size_t br = last.find('[');
    size = elem;
    if (br != std::string::npos) size = elem * (unsigned)std::strtoul(last.c_str() + br + 1, nullptr, 10);
    return true;
}

}  // namespace

bool parse_ptx(const std::string& ptx, std::vector<Entry>& out, std::string& why) {
    size_t pos = 0;
    while ((pos = ptx.find(".entry", pos)) != std::string::npos) {
        size_t name_start = pos + 6;
        while (name_start < ptx.size() && isspace((unsigned char)ptx[name_start])) name_start++;
        size_t open = ptx.find('(', name_start);
        size_t brace = ptx.find('{', name_start);
        Entry e;
        size_t name_end = name_start;
        while (name_end < ptx.size() && !isspace((unsigned char)ptx[name_end]) && ptx[name_end] != '(')
            name_end++;
        e.name = ptx.substr(name_start, name_end - name_start);
        if (open != std::string::npos && (brace == std::string::npos || open < brace)) {
            size_t close = ptx.find(')', open);
            if (close == std::string::npos) {
                why = "unterminated parameter list of " + e.name;
                return false;
            }
            std::string params = ptx.substr(open + 1, close - open - 1);
            size_t p = 0;
            while ((p = params.find(".param", p)) != std::string::npos) {
                size_t end = params.find(".param", p + 6);
                std::string decl = params.substr(p + 6, end == std::string::npos ? std::string::npos : end - p - 6);
                unsigned size;
                if (!parse_param(decl, size)) {
                    why = "unreadable parameter '" + decl + "' of " + e.name;
                    return false;
                }
                e.param_sizes.push_back(size);
                p += 6;
            }
            pos = close;
        } else {
            pos = name_end;
        }
        out.push_back(std::move(e));
    }
    if (out.empty()) {
        why = "no .entry in the PTX";
        return false;
    }
    return true;
}

namespace {

// Reads a T at off; v is zero when the image is too short.
template <typename T> bool rd(const unsigned char* base, size_t len, size_t off, T& v) {
    v = T{};
    if (off + sizeof(T) > len) return false;
    std::memcpy(&v, base + off, sizeof(T));
    return true;
}

// The kernels of one CUDA ELF (64-bit, little-endian).
bool parse_cubin(const unsigned char* e, size_t len, std::vector<Entry>& out, std::string& why) {
    if (len < 64 || std::memcmp(e, "\x7f" "ELF", 4) != 0 || e[4] != 2) {
        why = "not a 64-bit ELF cubin";
        return false;
    }
    uint64_t shoff;
    uint16_t shentsize, shnum, shstrndx;
    rd(e, len, 0x28, shoff);
    rd(e, len, 0x3a, shentsize);
    rd(e, len, 0x3c, shnum);
    rd(e, len, 0x3e, shstrndx);
    struct Sec {
        uint32_t name, type;
        uint64_t off, size;
        uint32_t link;
    };
    std::vector<Sec> secs(shnum);
    for (unsigned i = 0; i < shnum; i++) {
        size_t o = shoff + (size_t)i * shentsize;
        Sec& s = secs[i];
        if (!rd(e, len, o, s.name) || !rd(e, len, o + 4, s.type) || !rd(e, len, o + 24, s.off) ||
            !rd(e, len, o + 32, s.size) || !rd(e, len, o + 40, s.link)) {
            why = "truncated section table";
            return false;
        }
        if (s.off + s.size > len && s.type != 8 /* NOBITS */) {
            why = "section outside the image";
            return false;
        }
    }
    if (shstrndx >= shnum) {
        why = "no section names";
        return false;
    }
    auto str = [&](const Sec& tab, uint32_t off) -> std::string {
        if (off >= tab.size) return "";
        const char* p = reinterpret_cast<const char*>(e + tab.off + off);
        return std::string(p, strnlen(p, tab.size - off));
    };
    std::map<std::string, std::map<unsigned, unsigned>> params;  // kernel -> ordinal -> size
    for (const Sec& s : secs) {
        std::string n = str(secs[shstrndx], s.name);
        if (s.type == 2 /* SYMTAB */ && s.link < shnum) {
            for (uint64_t o = s.off; o + 24 <= s.off + s.size; o += 24) {
                uint32_t nm;
                unsigned char info;
                rd(e, len, o, nm);
                rd(e, len, o + 4, info);
                if ((info & 0xf) == 2 /* FUNC */ && (info >> 4) == 1 /* GLOBAL */)
                    out.push_back(Entry{str(secs[s.link], nm), {}});
            }
        }
        if (n.rfind(".nv.info.", 0) == 0) {
            std::string kernel = n.substr(9);
            auto& ps = params[kernel];
            ps.clear();
            for (uint64_t o = s.off; o + 4 <= s.off + s.size;) {
                unsigned char fmt = e[o], attr = e[o + 1];
                if (fmt != 4) {  // no-value, byte and half-word records are 4 bytes
                    o += 4;
                    continue;
                }
                uint16_t sz;
                rd(e, len, o + 2, sz);
                if (attr == 0x17 && sz >= 12) {  // EIATTR_KPARAM_INFO
                    uint16_t ordinal;
                    uint32_t flags;
                    rd(e, len, o + 8, ordinal);
                    rd(e, len, o + 12, flags);
                    ps[ordinal] = flags >> 18;
                }
                o += 4 + sz;
            }
        }
    }
    for (Entry& en : out) {
        auto it = params.find(en.name);
        if (it == params.end()) continue;
        for (unsigned i = 0; i < it->second.size(); i++) {
            auto p = it->second.find(i);
            if (p == it->second.end()) {
                why = "parameter " + std::to_string(i) + " of " + en.name + " missing";
                return false;
            }
            en.param_sizes.push_back(p->second);
        }
    }
    if (out.empty()) {
        why = "no kernel in the cubin";
        return false;
    }
    return true;
}

}  // namespace

bool parse_fatbin(const unsigned char* d, size_t len, std::vector<Entry>& out, std::string& why) {
    uint32_t magic;
    uint16_t hsize;
    uint64_t fsize;
    if (!rd(d, len, 0, magic) || magic != kFatbinMagic || !rd(d, len, 6, hsize) ||
        !rd(d, len, 8, fsize)) {
        why = "not a fatbin";
        return false;
    }
    size_t end = std::min<size_t>(len, hsize + fsize);
    bool any_ptx = false;
    for (size_t off = hsize; off + 16 <= end;) {
        uint16_t kind;
        uint32_t ehsize;
        uint64_t psize;
        rd(d, len, off, kind);
        rd(d, len, off + 4, ehsize);
        rd(d, len, off + 8, psize);
        if (off + ehsize + psize > end) {
            why = "truncated fatbin entry";
            return false;
        }
        if (kind == 2) return parse_cubin(d + off + ehsize, psize, out, why);
        if (kind == 1) any_ptx = true;
        off += ehsize + psize;
    }
    why = any_ptx ? "the fatbin holds only (compressed) PTX, which the simulator cannot read"
                  : "the fatbin holds no cubin";
    return false;
}

}  // namespace sim
