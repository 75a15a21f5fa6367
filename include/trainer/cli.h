// The command line: `trainer [train] --config FILE [--set section.key=value ...] [--dry-run]`.
#pragma once

#include <iosfwd>

namespace trainer {

// Parses the command line and runs the chosen subcommand. Returns the exit code for usage errors, --help and
// --version itself; errors of the run are thrown as trainer::Error for main to report.
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

// Every configuration key with its type, default and description, grouped by section.
void print_config_reference(std::ostream& out);
void print_config_reference_markdown(std::ostream& out);

}  // namespace trainer
