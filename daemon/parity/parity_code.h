// The Reed-Solomon code of a parity stripe, over GF(2^8), by Intel's ISA-L (its SIMD encode, update
// and table code): K data pieces and M parity shares, any K of the K + M pieces give back the rest.
// The matrix is ISA-L's Cauchy matrix (gf_gen_cauchy1_matrix), whose every K x K submatrix is
// invertible, so every choice of K survivors decodes.
//
// Pieces need not be as long as each other: a shorter piece counts as padded with zeros to the
// stripe's length, and a share is as long as the longest piece. A share can be built all at once
// (Encode) or one data piece at a time, in any order, as the pieces arrive from their members
// (Accumulate): a share that starts as zeros and has had every data piece added once equals the
// encoding. Assign writes a piece's term alone, as Accumulate into zeros would, so that memory that
// held anything before (a share of an earlier step, kept for the next) needs no zeroing first.
//
// A ParityCode is immutable once made: its methods may be called from any number of threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/base/status.h"

namespace flashckpt {

class ParityCode {
 public:
  // 1 <= data, 1 <= parity, data + parity <= 255.
  static Result<ParityCode> Make(uint32_t data, uint32_t parity);

  uint32_t data() const { return data_; }
  uint32_t parity() const { return parity_; }

  // Adds data piece `index` (< data()), `bytes` long, into share `row` (< parity()), which must be at
  // least `bytes` long; the share's bytes past `bytes` are left as they are.
  void Accumulate(uint32_t index, uint32_t row, const uint8_t* piece, size_t bytes, uint8_t* share) const;
  // Sets `bytes` bytes of share `row` to data piece `index`'s term alone: Accumulate into zeros.
  void Assign(uint32_t index, uint32_t row, const uint8_t* piece, size_t bytes, uint8_t* share) const;

  // Every share of data() pieces of `bytes` bytes each, at once: shares[r] receives `bytes` bytes.
  void Encode(const std::vector<const uint8_t*>& pieces, size_t bytes, const std::vector<uint8_t*>& shares) const;

  // A piece of a stripe as a rebuild sees it: data pieces are numbered 0..data()-1, shares
  // data()..data()+parity()-1. `bytes` null: lost. `size` may be less than the stripe's length.
  struct Piece {
    const uint8_t* bytes = nullptr;
    size_t size = 0;
  };
  // Where a rebuilt data piece goes: its index and `size` bytes at `out` (its first `size` bytes).
  struct Wanted {
    uint32_t index = 0;
    uint8_t* out = nullptr;
    size_t size = 0;
  };
  // Rebuilds the data pieces in `wanted` of a stripe `stripe_bytes` long from `pieces` (data() +
  // parity() entries). FAILED_PRECONDITION when fewer than data() pieces are present; INVALID_ARGUMENT
  // for a piece or a wanted size over `stripe_bytes`, or a wanted index that is not a data index.
  Status Rebuild(const std::vector<Piece>& pieces, size_t stripe_bytes, const std::vector<Wanted>& wanted) const;

 private:
  ParityCode(uint32_t data, uint32_t parity);

  uint32_t data_;
  uint32_t parity_;
  std::vector<uint8_t> matrix_;      // (data + parity) x data; the first data rows are the identity
  std::vector<uint8_t> tables_;      // ec_init_tables of every parity row at once (Encode)
  // ec_init_tables of each parity row alone (Accumulate): ISA-L's table layout is its own (it
  // differs between its SIMD flavours), so a row's tables are never cut out of tables_.
  std::vector<std::vector<uint8_t>> row_tables_;
  // ec_init_tables of one coefficient, (row, index) at row * data + index (Assign).
  std::vector<std::vector<uint8_t>> term_tables_;
};

}  // namespace flashckpt
