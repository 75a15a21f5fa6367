// Graceful stop: the first SIGINT or SIGTERM asks the training loop to finish the current optimizer step, write a
// checkpoint and exit (130 after SIGINT, 0 after SIGTERM, as a preempted container expects); a second one, half a
// second or more after the first, ends the process at once (a repeat within that is one stop delivered twice, as
// GNU timeout and process-group kills do). Checkpoints are written to a temporary directory and renamed, so
// stopping at any moment leaves the previous complete checkpoint loadable.
#pragma once

namespace trainer {

void install_stop_handlers();
// The signal that asked to stop (SIGINT, SIGTERM), or 0.
int stop_requested();

}  // namespace trainer
