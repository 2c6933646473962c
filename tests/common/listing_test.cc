// ListCheckpoints: what `flashckpt list` shows, from a root's files (the daemon's ListCheckpoints and
// the offline `flashckpt list --root` share it).
#include "common/read/listing.h"

#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/base/names.h"
#include "common/format/signal.h"
#include "common/io/fs.h"
#include "common/io/io_env.h"
#include "test_util.h"
#include "testing.h"

namespace flashckpt {
namespace {

using testing::Spec;
using testing::TempDir;

// Writes rank `rank`'s files of `step` of a 2-rank tp job and its signal, as node `node` would.
void SaveRank(const std::string& dir, int64_t step, uint32_t rank, const std::string& node) {
  ASSERT_OK(MakeDirs(dir, 0755));
  Topology t;
  t.world_size = 2;
  t.tp_degree = 2;
  t.tp_rank = rank;
  TensorSpec s = Spec("w", TensorKind::kModel, DType::kF32, {4, 4});
  s.global_shape = {8, 4};
  s.box_offset = {4 * rank, 0};
  s.box_shape = {4, 4};
  ASSERT_OK(testing::WriteRankFiles(dir, "job", rank, t, {s}, step, rank + 1));
  Signal signal;
  signal.rank = rank;
  signal.step = step;
  signal.node = node;
  signal.world_size = 2;
  signal.files = {"model_state.tp0" + std::to_string(rank) + "_pp00_shard00.safetensors"};
  ASSERT_OK(WriteFileDurably(dir, SignalFileName(rank), EncodeSignal("job", signal, 64)));
}

TEST(ListCheckpoints, ShowsWhichNodesSignalledAndTheWorldSizeOfAnIncompleteStep) {
  TempDir root;
  const std::string job = root.File("job");
  SaveRank(job + "/checkpoint-10", 10, 0, "node-a");
  SaveRank(job + "/checkpoint-10", 10, 1, "node-b");
  ASSERT_OK(testing::WriteMetadata(job + "/checkpoint-10"));
  SaveRank(job + "/checkpoint-20", 20, 1, "node-b");  // rank 0 (node-a) has not written step 20
  // A directory whose only signal is damaged: counted, without a node or a world size.
  ASSERT_OK(MakeDirs(job + "/checkpoint-30", 0755));
  ASSERT_OK(WriteFileDurably(job + "/checkpoint-30", "saved_signal_0", "{}"));
  ASSERT_OK(MakeDirs(root.File("not a job"), 0755));

  auto list = ListCheckpoints(root.path(), "");
  ASSERT_OK(list.status());
  ASSERT_EQ(list->size(), 3u);
  const CheckpointInfo& done = (*list)[0];
  EXPECT_EQ(done.step, 10);
  EXPECT_TRUE(done.complete);
  EXPECT_TRUE(done.latest);
  EXPECT_EQ(done.world_size, 2u);
  ASSERT_EQ(done.signalled.size(), 2u);
  EXPECT_EQ(done.signalled[0].rank, 0u);
  EXPECT_EQ(done.signalled[0].node, "node-a");
  EXPECT_EQ(done.signalled[1].node, "node-b");

  const CheckpointInfo& partial = (*list)[1];
  EXPECT_EQ(partial.step, 20);
  EXPECT_FALSE(partial.complete);
  EXPECT_FALSE(partial.latest);
  EXPECT_EQ(partial.signals, 1u);
  EXPECT_EQ(partial.world_size, 2u);  // from the signal: rank 0 is known to be missing
  ASSERT_EQ(partial.signalled.size(), 1u);
  EXPECT_EQ(partial.signalled[0].rank, 1u);
  EXPECT_EQ(partial.signalled[0].node, "node-b");

  const CheckpointInfo& damaged = (*list)[2];
  EXPECT_EQ(damaged.signals, 1u);
  EXPECT_TRUE(damaged.signalled.empty());
  EXPECT_EQ(damaged.world_size, 0u);

  // One job; an invalid job name is refused; a job without a directory has no checkpoints.
  auto one = ListCheckpoints(root.path(), "job");
  ASSERT_OK(one.status());
  EXPECT_EQ(one->size(), 3u);
  EXPECT_EQ(ListCheckpoints(root.path(), "../job").status().code(), StatusCode::kInvalidArgument);
  auto none = ListCheckpoints(root.path(), "other");
  ASSERT_OK(none.status());
  EXPECT_TRUE(none->empty());
}

// A complete checkpoint's world size comes from its signals: metadata.json, which grows with the
// job (320 MiB at 4096 ranks of 300 tensors), is not read, except for signals that do not say it.
TEST(ListCheckpoints, TakesTheWorldSizeFromTheSignalsWithoutReadingMetadata) {
  TempDir root;
  const std::string dir = root.File("job") + "/checkpoint-10";
  SaveRank(dir, 10, 0, "node-a");
  SaveRank(dir, 10, 1, "node-b");
  ASSERT_OK(testing::WriteMetadata(dir));
  CountingIo io(IoEnv::Default());
  auto list = ListCheckpoints(root.path(), "", &io);
  ASSERT_OK(list.status());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_TRUE((*list)[0].complete);
  EXPECT_EQ((*list)[0].world_size, 2u);
  EXPECT_EQ(io.Counts().opens, 2u) << "the two signals only";
  // Signals written before they recorded the world size: metadata.json says it.
  for (uint32_t r : {0u, 1u}) {
    Signal old;
    old.rank = r;
    old.step = 10;
    ASSERT_OK(WriteFileDurably(dir, SignalFileName(r), EncodeSignal("job", old, 64)));
  }
  list = ListCheckpoints(root.path(), "");
  ASSERT_OK(list.status());
  EXPECT_EQ((*list)[0].world_size, 2u);
}

TEST(NodeNames, TheHostNameIsAValidNodeNameAndBadNamesAreRefused) {
  EXPECT_OK(ValidateNodeName(DefaultNodeName()));
  EXPECT_OK(ValidateNodeName("gpu-07.rack3:a_b"));
  for (const std::string& bad : {std::string(), std::string("a/b"), std::string("a b"), std::string(65, 'x')}) {
    EXPECT_EQ(ValidateNodeName(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace flashckpt
