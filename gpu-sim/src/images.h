// Entry points of module images (PTX text or fatbin), for cuModuleLoadData and the build check.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace sim {

constexpr unsigned kFatbinMagic = 0xBA55ED50u;

struct Entry {
    std::string name;
    std::vector<unsigned> param_sizes;  // bytes, in parameter order
};

bool parse_ptx(const std::string& ptx, std::vector<Entry>& out, std::string& why);
bool parse_fatbin(const unsigned char* data, size_t len, std::vector<Entry>& out, std::string& why);

}  // namespace sim
