// See gloo/context.h: the stand-in declares everything ProcessGroupGloo.hpp needs.
#pragma once
#include <gloo/context.h>
