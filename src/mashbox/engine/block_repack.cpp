#include "cpu_kernels.h"

// A GGUF matrix's blocks into the kernels' layouts when a model loads, in one pass: what
// block_bits.torch_bits and cpu_kernels.pack_q4 / pack_q5 / pack_q6 / pack_q8 define in
// torch, whose many small strided uint8 ops took 42 s of an 8B-shaped Q4_K_M file's load.
// A tile of 32 outputs is decoded into a scratch that stays in cache and packed from there,
// so the whole matrix's integer weights never take memory (nor page faults) at once. The
// bits are the same as torch's (tests/test_block_repack.py, and the self-check).

namespace {

// GGMLQuantizationType's numbers.
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int64_t block_weights(int64_t qtype) { return qtype >= Q4_K ? 256 : 32; }

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "no block bits for GGML type ", qtype);
}

// A Q4_0 / Q4_1 / Q5_0 / Q5_1 block's 32 weights: byte j of its nibbles holds weight j (low)
// and j + 16 (high); the Q5s' fifth bit of weight j is bit j of the little-endian qh word.
void legacy_bits(int64_t qtype, const uint8_t* b, uint8_t* out) {
  const int scales = (qtype == Q4_1 || qtype == Q5_1) ? 4 : 2;
  const bool five = qtype == Q5_0 || qtype == Q5_1;
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, b + scales, 4);
  const uint8_t* qs = b + scales + (five ? 4 : 0);
  for (int j = 0; j < 16; ++j) {
    out[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    out[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

// A Q4_K / Q5_K block's 256 weights: 32 bytes of nibbles per 64 weights, sub-block 2c in the
// low nibbles and 2c + 1 in the high; Q5_K's fifth bit of sub-block s, weight l is bit s of
// qh[l].
void k_bits(int64_t qtype, const uint8_t* b, uint8_t* out) {
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (qtype == Q5_K ? 48 : 16);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      uint8_t low = qs[32 * c + l] & 0x0F, high = qs[32 * c + l] >> 4;
      if (qtype == Q5_K) {
        low |= ((qh[l] >> (2 * c)) & 1) << 4;
        high |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      out[64 * c + l] = low;
      out[64 * c + 32 + l] = high;
    }
  }
}

// A Q6_K block's 256 weights (0..63): weight 128h + 64s + j (j < 64) has nibble s of
// ql[64h + j] as its low four bits, weight 128h + 32s + j (j < 32) bits 2s, 2s + 1 of
// qh[32h + j] as its top two.
void q6_k_bits(const uint8_t* b, uint8_t* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 32; ++j) {
      const uint8_t l0 = ql[64 * h + j], l1 = ql[64 * h + 32 + j], top = qh[32 * h + j];
      out[128 * h + j] = (l0 & 0x0F) | ((top & 3) << 4);
      out[128 * h + 32 + j] = (l1 & 0x0F) | (((top >> 2) & 3) << 4);
      out[128 * h + 64 + j] = (l0 >> 4) | (((top >> 4) & 3) << 4);
      out[128 * h + 96 + j] = (l1 >> 4) | (((top >> 6) & 3) << 4);
    }
  }
}

void block_bits(int64_t qtype, const uint8_t* b, uint8_t* out) {
  if (qtype == Q6_K) {
    q6_k_bits(b, out);
  } else if (qtype >= Q4_K) {
    k_bits(qtype, b, out);
  } else {
    legacy_bits(qtype, b, out);
  }
}

// A matrix of parts (uint8 [rows, blocks, block bytes] each, of GGML type qtypes[i]) stacked
// along the outputs, read a row at a time.
class Matrix {
 public:
  Matrix(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& qtypes)
      : parts_(parts), qtypes_(qtypes) {
    TORCH_CHECK(!parts.empty() && parts.size() == qtypes.size(), "one GGML type per part");
    k_ = parts[0].size(1) * block_weights(qtypes[0]);
    first_row_.push_back(0);
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto& p = parts[i];
      TORCH_CHECK(p.dtype() == at::kByte && p.dim() == 3 && p.is_contiguous(),
                  "blocks: contiguous uint8 [rows, blocks, bytes]");
      TORCH_CHECK(p.size(2) == block_bytes(qtypes[i]), "a block of type ", qtypes[i], " is ",
                  block_bytes(qtypes[i]), " bytes, not ", p.size(2));
      TORCH_CHECK(p.size(1) * block_weights(qtypes[i]) == k_, "parts of different widths");
      first_row_.push_back(first_row_.back() + p.size(0));
    }
  }
  int64_t rows() const { return first_row_.back(); }
  int64_t k() const { return k_; }

  // Row r's blocks, of GGML type *qtype.
  const uint8_t* row_blocks(int64_t r, int64_t* qtype) const {
    const size_t part = std::upper_bound(first_row_.begin(), first_row_.end(), r) -
                        first_row_.begin() - 1;
    *qtype = qtypes_[part];
    const int64_t row_bytes = k_ / block_weights(*qtype) * block_bytes(*qtype);
    return parts_[part].data_ptr<uint8_t>() + (r - first_row_[part]) * row_bytes;
  }

  // Row r's K integer weights into out.
  void row(int64_t r, uint8_t* out) const {
    int64_t qtype;
    const uint8_t* blocks = row_blocks(r, &qtype);
    const int64_t bytes = block_bytes(qtype), weights = block_weights(qtype);
    for (int64_t b = 0; b < k_ / weights; ++b) {
      block_bits(qtype, blocks + b * bytes, out + b * weights);
    }
  }

  // f(r, s, block) for each row r's super-block s of 256 weights (K-quant parts of the types
  // `allowed` only), on torch's threads.
  template <typename F>
  void super_blocks(std::initializer_list<int64_t> allowed, const F& f) const {
    TORCH_CHECK(rows() % TILE_LANES == 0, "N a multiple of 32, not ", rows());
    for (int64_t qtype : qtypes_) {
      TORCH_CHECK(std::find(allowed.begin(), allowed.end(), qtype) != allowed.end(),
                  "no such scales for GGML type ", qtype);
    }
    at::parallel_for(0, rows(), TILE_LANES, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int64_t qtype;
        const uint8_t* blocks = row_blocks(r, &qtype);
        for (int64_t s = 0; s < k_ / 256; ++s) f(r, s, blocks + s * block_bytes(qtype));
      }
    });
  }

  // f(t, q) for each tile t of 32 outputs, q its rows' weights [32, K], on torch's threads.
  template <typename F>
  void tiles(const F& f) const {
    TORCH_CHECK(rows() % TILE_LANES == 0, "N a multiple of 32, not ", rows());
    at::parallel_for(0, rows() / TILE_LANES, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> q(TILE_LANES * k_);  // a tile's weights stay in L2 while packed
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t o = 0; o < TILE_LANES; ++o) row(t * TILE_LANES + o, q.data() + o * k_);
        f(t, q.data());
      }
    });
  }

 private:
  const std::vector<at::Tensor>& parts_;
  const std::vector<int64_t>& qtypes_;
  std::vector<int64_t> first_row_;
  int64_t k_ = 0;
};

// A tile's weights q [32, K] as pack_q4's records (their low nibbles), each followed by
// `planes` bit planes (pack_q5's fifth bits; pack_q6's fifth and sixth): record g holds
// weights 8g..8g + 7; output o's byte j (j < 4) weight 8g + j in its low nibble and
// 8g + j + 4 in its high; plane p's bit 128h + 4o + j (little-endian) is bit 4 + p of weight
// 8g + 4h + j.
void pack_tile_bits(const uint8_t* q, int64_t k, int64_t planes, uint8_t* out) {
  const int64_t record = 4 * TILE_LANES + TILE_LANES * planes;
  for (int64_t g = 0; g < k / 8; ++g) {
    uint8_t* rec = out + g * record;
    std::memset(rec + 4 * TILE_LANES, 0, TILE_LANES * planes);
    for (int o = 0; o < TILE_LANES; ++o) {
      const uint8_t* w = q + o * k + 8 * g;
      for (int j = 0; j < 4; ++j) rec[4 * o + j] = (w[j] & 0x0F) | ((w[j + 4] & 0x0F) << 4);
      for (int p = 0; p < planes; ++p) {
        uint8_t* plane = rec + (4 + p) * TILE_LANES;
        for (int h = 0; h < 2; ++h) {
          const int bit = 128 * h + 4 * o;  // + j: four bits of one byte
          uint8_t four = 0;
          for (int j = 0; j < 4; ++j) four |= ((w[4 * h + j] >> (4 + p)) & 1) << j;
          plane[bit >> 3] |= four << (bit & 7);
        }
      }
    }
  }
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The K-quant parts' scales (of the types `allowed`) as T [N / 32, K / 256, width]: each
// tile's `width` values per super-block, f(at, o, block) writing output o's share of them.
template <typename T, typename F>
at::Tensor pack_per_super(const std::vector<at::Tensor>& parts,
                          const std::vector<int64_t>& qtypes,
                          std::initializer_list<int64_t> allowed, int64_t width, const F& f) {
  const Matrix m(parts, qtypes);
  const int64_t supers = m.k() / 256;
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  at::Tensor out = at::empty({m.rows() / TILE_LANES, supers, width}, dtype);
  T* dst = out.data_ptr<T>();
  m.super_blocks(allowed, [&](int64_t r, int64_t s, const uint8_t* b) {
    f(dst + (r / TILE_LANES * supers + s) * width, static_cast<int>(r % TILE_LANES), b);
  });
  return out;
}

}  // namespace

// The integer weights q uint8 [N, K] (0..15, 0..31 for the Q5s, 0..63 for Q6_K) of a
// matrix's parts (uint8 [rows, blocks, block bytes] each, of GGML type qtypes[i]) stacked
// along the outputs: block_bits.torch_bits of each, concatenated.
at::Tensor block_bits(const std::vector<at::Tensor>& parts,
                      const std::vector<int64_t>& qtypes) {
  const Matrix m(parts, qtypes);
  auto q = at::empty({m.rows(), m.k()}, at::kByte);
  uint8_t* out = q.data_ptr<uint8_t>();
  at::parallel_for(0, m.rows(), 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) m.row(r, out + r * m.k());
  });
  return q;
}

// The parts' weights as pack_q4 (planes 0), pack_q5 (1) or pack_q6 (2) lay them out:
// uint8 [N / 32, K / 8, 128 + 32 * planes], never the whole of q at once.
at::Tensor pack_blocks(const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& qtypes, int64_t planes) {
  TORCH_CHECK(planes >= 0 && planes <= 2, "0, 1 or 2 bit planes");
  const Matrix m(parts, qtypes);
  const int64_t record = 4 * TILE_LANES + TILE_LANES * planes;
  auto qs = at::empty({m.rows() / TILE_LANES, m.k() / 8, record}, at::kByte);
  uint8_t* out = qs.data_ptr<uint8_t>();
  m.tiles([&](int64_t t, const uint8_t* q) {
    pack_tile_bits(q, m.k(), planes, out + t * (m.k() / 8) * record);
  });
  return qs;
}

// The parts' weights less `offset` as int8, laid out as pack_q8 lays out its q: int8
// [N / 32, K / 2, 64], output o's weights 2i and 2i + 1 at [.., i, 2o] and [.., i, 2o + 1]
// (Q6_K's q - 32 for the prefill chunks' kernel).
at::Tensor pack_blocks_q8(const std::vector<at::Tensor>& parts,
                          const std::vector<int64_t>& qtypes, int64_t offset) {
  const Matrix m(parts, qtypes);
  const int64_t k = m.k();
  auto qs = at::empty({m.rows() / TILE_LANES, k / 2, 2 * TILE_LANES}, at::kChar);
  int8_t* out = qs.data_ptr<int8_t>();
  m.tiles([&](int64_t t, const uint8_t* q) {
    int8_t* tile = out + t * k * TILE_LANES;
    for (int64_t i = 0; i < k / 2; ++i) {
      for (int o = 0; o < TILE_LANES; ++o) {
        tile[i * 2 * TILE_LANES + 2 * o] = static_cast<int8_t>(q[o * k + 2 * i] - offset);
        tile[i * 2 * TILE_LANES + 2 * o + 1] = static_cast<int8_t>(q[o * k + 2 * i + 1] - offset);
      }
    }
  });
  return qs;
}

// The Q4_K / Q5_K parts' scales as stored, laid out as cpu_kernels.pack_k_scales lays out
// int4.k_scales': uint8 [N / 32, K / 256, 640], per tile and super-block sc [8][32],
// mn [8][32], fp16 d [32] and -dmin [32]. Sub-block j's six-bit scale and min: bytes 4-7
// (scales) and 8-11 (mins) hold sub-blocks 0-3's in their low six bits and 4-7's top two
// bits; the nibbles of bytes 12-15 hold 4-7's low four (scale low, min high).
at::Tensor blocks_k_scales(const std::vector<at::Tensor>& parts,
                           const std::vector<int64_t>& qtypes) {
  auto pack = [](uint8_t* at, int o, const uint8_t* b) {
    const uint8_t* packed = b + 4;
    for (int j = 0; j < 4; ++j) {
      at[j * TILE_LANES + o] = packed[j] & 0x3F;
      at[(8 + j) * TILE_LANES + o] = packed[j + 4] & 0x3F;
      const uint8_t mixed = packed[j + 8];
      at[(4 + j) * TILE_LANES + o] = (mixed & 0x0F) | ((packed[j] >> 2) & 0x30);
      at[(12 + j) * TILE_LANES + o] = (mixed >> 4) | ((packed[j + 4] >> 2) & 0x30);
    }
    const uint16_t d = load_u16(b), minus_dmin = load_u16(b + 2) ^ 0x8000;  // fp16's sign
    std::memcpy(at + 16 * TILE_LANES + 2 * o, &d, 2);
    std::memcpy(at + 18 * TILE_LANES + 2 * o, &minus_dmin, 2);
  };
  return pack_per_super<uint8_t>(parts, qtypes, {Q4_K, Q5_K}, 20 * TILE_LANES, pack);
}

// The Q6_K parts' scales as cpu_kernels.pack_q6_scales lays out q6_weight.q6_k_scales':
// uint8 [N / 32, K / 256, 576], per tile and super-block int8 sc [16][32], then fp16 d [32].
at::Tensor blocks_q6_scales(const std::vector<at::Tensor>& parts,
                            const std::vector<int64_t>& qtypes) {
  auto pack = [](uint8_t* at, int o, const uint8_t* b) {
    for (int j = 0; j < 16; ++j) at[j * TILE_LANES + o] = b[192 + j];
    std::memcpy(at + 16 * TILE_LANES + 2 * o, b + 208, 2);
  };
  return pack_per_super<uint8_t>(parts, qtypes, {Q6_K}, 18 * TILE_LANES, pack);
}

// The Q6_K parts' d * sc per 16 weights (q6_weight.group_scales, exact in float32) as
// cpu_kernels.pack_q8_scales lays them out: float32 [N / 32, K / 16, 32].
at::Tensor blocks_q6_group_scales(const std::vector<at::Tensor>& parts,
                                  const std::vector<int64_t>& qtypes) {
  auto pack = [](float* at, int o, const uint8_t* b) {
    const float d = static_cast<float>(c10::Half(load_u16(b + 208), c10::Half::from_bits()));
    for (int j = 0; j < 16; ++j) at[j * TILE_LANES + o] = d * static_cast<int8_t>(b[192 + j]);
  };
  auto scales = pack_per_super<float>(parts, qtypes, {Q6_K}, 16 * TILE_LANES, pack);
  return scales.view({scales.size(0), -1, TILE_LANES});
}
