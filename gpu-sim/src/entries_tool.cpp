// gpusim-entries IMAGE: prints the entry points of a PTX file or a fatbin, one per line, as
// `name size,size,...` (parameter sizes in bytes). The build uses it to generate the kernel
// registrations and their size checks from nvcc's PTX.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "images.h"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: gpusim-entries IMAGE\n");
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in && data.empty()) {
        std::fprintf(stderr, "gpusim-entries: cannot read %s\n", argv[1]);
        return 1;
    }
    std::vector<sim::Entry> entries;
    std::string why;
    unsigned magic = 0;
    if (data.size() >= 4) std::memcpy(&magic, data.data(), 4);
    bool ok = magic == sim::kFatbinMagic
                  ? sim::parse_fatbin(reinterpret_cast<const unsigned char*>(data.data()),
                                      data.size(), entries, why)
                  : sim::parse_ptx(data, entries, why);
    if (!ok) {
        std::fprintf(stderr, "gpusim-entries: %s: %s\n", argv[1], why.c_str());
        return 1;
    }
    for (const auto& e : entries) {
        std::printf("%s ", e.name.c_str());
        for (size_t i = 0; i < e.param_sizes.size(); i++)
            std::printf("%s%u", i ? "," : "", e.param_sizes[i]);
        std::printf("\n");
    }
    return 0;
}
