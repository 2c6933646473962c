#include "daemon/parity/parity_code.h"

#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>

namespace flashckpt {
namespace {

// Rebuilds run over the stripe in chunks: a piece shorter than the stripe is padded with zeros one
// chunk at a time, not copied whole, and the chunk stays in cache across the sources.
constexpr size_t kRebuildChunk = 256 * 1024;

}  // namespace

Result<ParityCode> ParityCode::Make(uint32_t data, uint32_t parity) {
  if (data < 1 || parity < 1 || data + parity > 255) {
    return InvalidArgument("a Reed-Solomon stripe has at least 1 data and 1 parity piece and at most 255 in all, not " +
                           std::to_string(data) + " + " + std::to_string(parity));
  }
  return ParityCode(data, parity);
}

ParityCode::ParityCode(uint32_t data, uint32_t parity)
    : data_(data), parity_(parity), matrix_(size_t{data + parity} * data), tables_(size_t{32} * data * parity) {
  gf_gen_cauchy1_matrix(matrix_.data(), static_cast<int>(data + parity), static_cast<int>(data));
  ec_init_tables(static_cast<int>(data), static_cast<int>(parity), &matrix_[size_t{data} * data], tables_.data());
  for (uint32_t r = 0; r < parity; ++r) {
    std::vector<uint8_t>& row = row_tables_.emplace_back(size_t{32} * data);
    ec_init_tables(static_cast<int>(data), 1, &matrix_[size_t{data + r} * data], row.data());
    for (uint32_t d = 0; d < data; ++d) {
      std::vector<uint8_t>& term = term_tables_.emplace_back(32);
      ec_init_tables(1, 1, &matrix_[size_t{data + r} * data + d], term.data());
    }
  }
}

void ParityCode::Accumulate(uint32_t index, uint32_t row, const uint8_t* piece, size_t bytes, uint8_t* share) const {
  if (bytes == 0) return;
  unsigned char* row_tables = const_cast<unsigned char*>(row_tables_[row].data());
  unsigned char* out[1] = {share};
  ec_encode_data_update(static_cast<int>(bytes), static_cast<int>(data_), 1, static_cast<int>(index), row_tables,
                        const_cast<unsigned char*>(piece), out);
}

void ParityCode::Assign(uint32_t index, uint32_t row, const uint8_t* piece, size_t bytes, uint8_t* share) const {
  if (bytes == 0) return;
  unsigned char* term = const_cast<unsigned char*>(term_tables_[size_t{row} * data_ + index].data());
  unsigned char* in[1] = {const_cast<unsigned char*>(piece)};
  unsigned char* out[1] = {share};
  ec_encode_data(static_cast<int>(bytes), 1, 1, term, in, out);
}

void ParityCode::Encode(const std::vector<const uint8_t*>& pieces, size_t bytes,
                        const std::vector<uint8_t*>& shares) const {
  if (bytes == 0) return;
  std::vector<unsigned char*> in(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) in[i] = const_cast<unsigned char*>(pieces[i]);
  std::vector<unsigned char*> out(shares.begin(), shares.end());
  ec_encode_data(static_cast<int>(bytes), static_cast<int>(data_), static_cast<int>(parity_),
                 const_cast<unsigned char*>(tables_.data()), in.data(), out.data());
}

Status ParityCode::Rebuild(const std::vector<Piece>& pieces, size_t stripe_bytes,
                           const std::vector<Wanted>& wanted) const {
  if (pieces.size() != size_t{data_} + parity_) {
    return InvalidArgument("a rebuild needs all " + std::to_string(data_ + parity_) + " pieces of a stripe, lost or not; got " +
                           std::to_string(pieces.size()));
  }
  for (const Wanted& w : wanted) {
    if (w.index >= data_) return InvalidArgument("piece " + std::to_string(w.index) + " is not a data piece");
    if (w.size > stripe_bytes) return InvalidArgument("a rebuilt piece cannot be longer than its stripe");
  }
  std::vector<uint32_t> present;
  for (uint32_t i = 0; i < pieces.size() && present.size() < data_; ++i) {
    if (pieces[i].bytes == nullptr) continue;
    if (pieces[i].size > stripe_bytes) return InvalidArgument("a piece cannot be longer than its stripe");
    present.push_back(i);
  }
  if (present.size() < data_) {
    return FailedPrecondition("a stripe of " + std::to_string(data_) + " data and " + std::to_string(parity_) +
                              " parity pieces needs " + std::to_string(data_) + " to rebuild, and " +
                              std::to_string(present.size()) + " are left");
  }
  if (wanted.empty() || stripe_bytes == 0) return Status::OK();

  // The rows of the present pieces form an invertible K x K matrix (Cauchy); its inverse maps them
  // back to the data, and the wanted data pieces are its rows.
  const size_t k = data_;
  std::vector<uint8_t> chosen(k * k), inverse(k * k);
  for (size_t i = 0; i < k; ++i) std::memcpy(&chosen[i * k], &matrix_[present[i] * k], k);
  if (gf_invert_matrix(chosen.data(), inverse.data(), static_cast<int>(k)) != 0) {
    return Internal("the Cauchy submatrix of a parity stripe did not invert");
  }
  std::vector<uint8_t> rows(wanted.size() * k);
  for (size_t w = 0; w < wanted.size(); ++w) std::memcpy(&rows[w * k], &inverse[wanted[w].index * k], k);
  std::vector<uint8_t> tables(32 * k * wanted.size());
  ec_init_tables(static_cast<int>(k), static_cast<int>(wanted.size()), rows.data(), tables.data());

  // Sources shorter than a chunk's end, and outputs that end inside it, go through zero-padded scratch.
  std::vector<std::vector<uint8_t>> pad_in(k), pad_out(wanted.size());
  std::vector<unsigned char*> in(k), out(wanted.size());
  for (size_t offset = 0; offset < stripe_bytes; offset += kRebuildChunk) {
    const size_t n = std::min(kRebuildChunk, stripe_bytes - offset);
    for (size_t i = 0; i < k; ++i) {
      const Piece& piece = pieces[present[i]];
      if (piece.size >= offset + n) {
        in[i] = const_cast<unsigned char*>(piece.bytes + offset);
        continue;
      }
      pad_in[i].assign(n, 0);
      if (piece.size > offset) std::memcpy(pad_in[i].data(), piece.bytes + offset, piece.size - offset);
      in[i] = pad_in[i].data();
    }
    for (size_t w = 0; w < wanted.size(); ++w) {
      if (wanted[w].size >= offset + n) {
        out[w] = wanted[w].out + offset;
      } else {
        pad_out[w].resize(n);
        out[w] = pad_out[w].data();
      }
    }
    ec_encode_data(static_cast<int>(n), static_cast<int>(k), static_cast<int>(wanted.size()), tables.data(), in.data(),
                   out.data());
    for (size_t w = 0; w < wanted.size(); ++w) {
      if (wanted[w].size >= offset + n || wanted[w].size <= offset) continue;
      std::memcpy(wanted[w].out + offset, pad_out[w].data(), wanted[w].size - offset);
    }
  }
  return Status::OK();
}

}  // namespace flashckpt
