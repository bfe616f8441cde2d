// The test suites outside the plugins include the harness's ScratchDir by this name (their
// targets do not all have the core's include folder).
#pragma once

#include "../../core/include/modalities/testing/scratch_dir.h"
