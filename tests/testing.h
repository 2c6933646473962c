// Test helpers shared by every gtest binary.
#pragma once

#include <gtest/gtest.h>

#include "flashckpt/status.h"

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::flashckpt::Status _fc_s = (expr);                  \
    ASSERT_TRUE(_fc_s.ok()) << #expr << " -> " << _fc_s.ToString(); \
  } while (0)

#define EXPECT_OK(expr)                                        \
  do {                                                         \
    const ::flashckpt::Status _fc_s = (expr);                  \
    EXPECT_TRUE(_fc_s.ok()) << #expr << " -> " << _fc_s.ToString(); \
  } while (0)
