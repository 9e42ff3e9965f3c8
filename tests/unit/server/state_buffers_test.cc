// One copy of the state (server/engine/state_buffers.h): a sealed step writes in place, what is
// computed before the seal goes to a window buffer swapped in at the commit, a refused step that
// wrote only windows leaves the front bit-identical, the window keeps only what the last step
// used, and a save in progress gets the committed values of arrays written in place afterwards
// (copy-on-write per array). Two copies behave as before: every array has its back, Unflip
// undoes a kept flip.
#include "server/engine/state_buffers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

constexpr size_t kN = 1000;

void Fill(float* d, float v) { std::fill(d, d + kN, v); }

bool All(const float* d, float v) {
  return std::all_of(d, d + kN, [v](float x) { return x == v; });
}

class StateBuffersTest : public ::testing::Test {
 protected:
  std::unique_ptr<device::Device> device_ = device::NewHostDevice(1, nullptr);
};

TEST_F(StateBuffersTest, OneCopyHoldsTheStateOnceAndNoWindowUntilAStepUsesOne) {
  StateBuffers s({kN, kN, kN}, device_.get(), /*window_bytes=*/kN * sizeof(float));
  EXPECT_FALSE(s.two_copies());
  const StateBuffers::Held h = s.held();
  EXPECT_EQ(h.front, 3 * kN * sizeof(float));
  EXPECT_EQ(h.back, 0u);
  StateBuffers two({kN, kN, kN}, device_.get());
  EXPECT_TRUE(two.two_copies());
  EXPECT_EQ(two.held().back, 3 * kN * sizeof(float)) << "two copies: every back up front";
}

TEST_F(StateBuffersTest, InPlaceAndWindowArraysCommitTogether) {
  StateBuffers s({kN, kN, kN}, device_.get(), kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    for (size_t a = 0; a < 3; ++a) Fill(lock.mutable_front(a), 1);
  }
  s.BeginStep();
  s.Plan(0, /*in_place=*/false);  // computed before the seal
  s.Plan(1, /*in_place=*/true);   // after it
  float* w0 = s.back(0);
  float* p1 = s.back(1);
  EXPECT_NE(w0, s.front(0));
  EXPECT_EQ(p1, s.front(1)) << "in place: the step writes the committed buffer";
  Fill(w0, 2);
  Fill(p1, 3);
  EXPECT_TRUE(All(s.front(0), 1)) << "the window is not visible before the commit";
  EXPECT_EQ(s.held().back, kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  EXPECT_TRUE(All(s.front(0), 2));
  EXPECT_TRUE(All(s.front(1), 3));
  EXPECT_TRUE(All(s.front(2), 1)) << "an array the step did not write keeps its value";
  EXPECT_EQ(s.held().back, kN * sizeof(float)) << "the window buffer array 0 used stays";

  // The next step uses the window for array 2 only: array 0's window buffer is freed at its
  // commit, so the window never holds more than one step reserved.
  s.BeginStep();
  s.Plan(2, false);
  Fill(s.back(2), 5);
  EXPECT_EQ(s.held().back, 2 * kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  EXPECT_TRUE(All(s.front(0), 2));
  EXPECT_TRUE(All(s.front(2), 5));
  EXPECT_EQ(s.held().back, kN * sizeof(float));
}

TEST_F(StateBuffersTest, AStepThatWroteOnlyWindowsLeavesTheFrontBitIdentical) {
  StateBuffers s({kN, kN}, device_.get(), 2 * kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    Fill(lock.mutable_front(0), 1);
    Fill(lock.mutable_front(1), 1);
  }
  s.BeginStep();
  s.Plan(0, false);
  s.Plan(1, false);
  Fill(s.back(0), 9);
  Fill(s.back(1), 9);
  // Refused: no flip; the next step begins afresh and commits only what it writes.
  s.BeginStep();
  EXPECT_TRUE(All(s.front(0), 1));
  EXPECT_TRUE(All(s.front(1), 1));
  s.Plan(1, true);
  Fill(s.back(1), 4);
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  EXPECT_TRUE(All(s.front(0), 1)) << "the refused step's window of array 0 is not committed";
  EXPECT_TRUE(All(s.front(1), 4));
}

TEST_F(StateBuffersTest, ASaveKeepsTheCommittedValuesOfArraysWrittenInPlaceAfterItBegan) {
  StateBuffers s({kN, kN}, device_.get(), kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    Fill(lock.mutable_front(0), 1);
    Fill(lock.mutable_front(1), 1);
    lock.BeginSnapshot();
  }
  std::vector<float> copied;
  s.CopyForSnapshot(0, &copied);  // the writer has array 0 before the step
  s.BeginStep();
  s.Plan(0, true);
  s.Plan(1, true);  // the writer has not reached it: copy-on-write
  Fill(s.back(0), 7);
  Fill(s.back(1), 7);
  EXPECT_EQ(s.snapshot_cost().change_copied, kN * sizeof(float)) << "array 1 only";
  EXPECT_EQ(s.held().snapshot, kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  EXPECT_TRUE(All(copied.data(), 1));
  s.CopyForSnapshot(1, &copied);
  EXPECT_TRUE(All(copied.data(), 1)) << "the save gets the committed value, not the step's";
  s.EndSnapshot();
  EXPECT_TRUE(All(s.front(0), 7));
  EXPECT_TRUE(All(s.front(1), 7));
  EXPECT_EQ(s.held().snapshot, 0u);
  // Array 1's old front, released by the writer, is freed: no step wrote a window, so the store
  // holds its state once (not kept as a window buffer beyond the step window).
  EXPECT_EQ(s.held().back + s.held().spare, 0u) << "a released buffer was kept";
}

// A save that begins while a sealed step writes in place would copy a front that is part old,
// part new: the snapshot's lock is taken only at a step boundary, after the commit.
TEST_F(StateBuffersTest, ASnapshotWaitsForASealedStepWritingInPlace) {
  StateBuffers s({kN, kN}, device_.get(), kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    Fill(lock.mutable_front(0), 1);
    Fill(lock.mutable_front(1), 1);
  }
  s.BeginStep();
  s.Plan(0, /*in_place=*/true);
  Fill(s.back(0), 2);  // array 0 is new, array 1 not yet
  std::atomic<bool> began{false};
  std::thread saver([&] {
    StateBuffers::Lock lock(s, StateBuffers::Lock::AtStepBoundary{});
    lock.BeginSnapshot();
    began = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(began) << "a snapshot began in the middle of an in-place step";
  s.Plan(1, true);
  Fill(s.back(1), 2);
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  saver.join();
  EXPECT_TRUE(began);
  std::vector<float> copied;
  s.CopyForSnapshot(0, &copied);
  EXPECT_TRUE(All(copied.data(), 2));
  s.CopyForSnapshot(1, &copied);
  EXPECT_TRUE(All(copied.data(), 2)) << "the snapshot is the committed step, whole";
  s.EndSnapshot();

  // A step that fails after writing in place (the job is fenced) also ends the wait.
  s.BeginStep();
  s.Plan(0, true);
  std::thread waiter([&] { StateBuffers::Lock lock(s, StateBuffers::Lock::AtStepBoundary{}); });
  s.DropWindow();
  waiter.join();
  // A step that wrote only windows is no reason to wait.
  s.BeginStep();
  s.Plan(0, false);
  StateBuffers::Lock lock(s, StateBuffers::Lock::AtStepBoundary{});
}

// The writer releases a buffer it was handed while a step writes the array's window: the window
// buffer the step writes stays, and is what the commit swaps in.
TEST_F(StateBuffersTest, ASaveReleasingItsBufferNeverTakesAWindowTheStepWrites) {
  StateBuffers s(std::vector<size_t>{kN}, device_.get(), kN * sizeof(float));
  {
    StateBuffers::Lock lock(s);
    Fill(lock.mutable_front(0), 1);
    lock.BeginSnapshot();
  }
  s.BeginStep();
  s.Plan(0, false);
  Fill(s.back(0), 2);
  {
    StateBuffers::Lock lock(s);
    lock.Flip();  // the old front (the snapshot's) is now the window buffer
  }
  s.BeginStep();
  s.Plan(0, false);  // handed to the snapshot; the step gets a fresh (unpinned) buffer
  Fill(s.back(0), 3);
  std::vector<float> copied;
  s.CopyForSnapshot(0, &copied);  // the writer is done with it: released
  EXPECT_TRUE(All(copied.data(), 1));
  {
    StateBuffers::Lock lock(s);
    lock.Flip();
  }
  s.EndSnapshot();
  EXPECT_TRUE(All(s.front(0), 3)) << "the step's value was lost to a released buffer";
}

TEST_F(StateBuffersTest, TwoCopiesNeverWriteInPlaceAndUnflipRestores) {
  StateBuffers s({kN, kN}, device_.get());
  {
    StateBuffers::Lock lock(s);
    Fill(lock.mutable_front(0), 1);
    Fill(lock.mutable_front(1), 1);
  }
  s.BeginStep();
  s.Plan(0, /*in_place=*/true);  // asked, but a two-copy store writes its back
  EXPECT_NE(s.back(0), s.front(0));
  Fill(s.back(0), 2);
  Fill(s.back(1), 2);  // unplanned: the back as well
  {
    StateBuffers::Lock lock(s);
    lock.Flip(/*keep_back=*/true);
  }
  EXPECT_TRUE(All(s.front(0), 2));
  EXPECT_TRUE(All(s.front(1), 2));
  {
    StateBuffers::Lock lock(s);
    lock.Unflip();
  }
  EXPECT_TRUE(All(s.front(0), 1));
  EXPECT_TRUE(All(s.front(1), 1));
}

}  // namespace
}  // namespace muond::server
