// resume.cpp: the run resume this plugin registers (RunResumeSpec).
#pragma once

#include <modalities/sdk/registrar.h>

#include <string>

namespace modalities::plugins::checkpointing {

/// The warm-start form of a run config whose last checkpoint `info_file` names; `app_state` is the
/// config's app_state node (app_state/raw). Throws modalities::Error.
ResumedRun resume_run(const std::string& info_file, const Value& app_state);

}  // namespace modalities::plugins::checkpointing
