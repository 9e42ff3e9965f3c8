// DeletionHooks (server/jobs/deletion_hooks.h): each hook runs once at Fire(), a hook registered
// after Fire() runs at once, and a destroyed or reset registration never runs.
#include "server/jobs/deletion_hooks.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

TEST(DeletionHooksTest, EachHookRunsOnceAtFire) {
  DeletionHooks hooks;
  int a = 0, b = 0;
  auto ra = hooks.Register([&] { ++a; });
  auto rb = hooks.Register([&] { ++b; });
  EXPECT_EQ(hooks.size(), 2u);
  EXPECT_EQ(a + b, 0);
  hooks.Fire();
  hooks.Fire();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(hooks.size(), 0u);
}

TEST(DeletionHooksTest, RegisteredAfterFireRunsAtOnce) {
  DeletionHooks hooks;
  hooks.Fire();
  int ran = 0;
  auto r = hooks.Register([&] { ++ran; });
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(hooks.size(), 0u);
}

TEST(DeletionHooksTest, UnregisteredHookNeverRuns) {
  DeletionHooks hooks;
  int ran = 0;
  {
    auto gone = hooks.Register([&] { ran += 10; });
  }
  auto reset = hooks.Register([&] { ran += 100; });
  reset.Reset();
  auto moved_from = hooks.Register([&] { ++ran; });
  DeletionHooks::Registration kept = std::move(moved_from);
  EXPECT_EQ(hooks.size(), 1u);
  hooks.Fire();
  EXPECT_EQ(ran, 1);
}

TEST(DeletionHooksTest, RegistrationMayOutliveTheList) {
  int ran = 0;
  DeletionHooks::Registration r;
  {
    DeletionHooks hooks;
    r = hooks.Register([&] { ++ran; });
  }
  r.Reset();  // the shared state is still there
  EXPECT_EQ(ran, 0);
}

TEST(DeletionHooksTest, FireRacesWithUnregistering) {
  // A hook either ran before its registration was dropped or never runs: the counter of hooks
  // that ran while their owner was gone stays 0.
  for (int round = 0; round < 50; ++round) {
    DeletionHooks hooks;
    std::vector<std::unique_ptr<std::atomic<bool>>> alive;
    std::vector<DeletionHooks::Registration> regs;
    std::atomic<int> ran_dead{0};
    for (int i = 0; i < 32; ++i) {
      alive.push_back(std::make_unique<std::atomic<bool>>(true));
      std::atomic<bool>* a = alive.back().get();
      regs.push_back(hooks.Register([a, &ran_dead] {
        if (!a->load()) ran_dead.fetch_add(1);
      }));
    }
    std::thread fire([&] { hooks.Fire(); });
    for (int i = 0; i < 32; ++i) {
      regs[i].Reset();
      alive[i]->store(false);
    }
    fire.join();
    EXPECT_EQ(ran_dead.load(), 0);
  }
}

}  // namespace
}  // namespace muond::server
