#pragma once
//! \file
//! Umbrella header for all of qcoll, CUDA parts included; needs nvcc.

#include "qcoll.hpp"
