// The integers that cross the boundary to Python (FFI attributes, binding arguments) are C++ enums
// whose names and values are listed once, in an X-macro beside each enum:
//   #define JAX_UB_FOO(X) X(kA, "a", 0) X(kB, "b", 1)
//   enum class Foo : int { JAX_UB_FOO(JAX_UB_ENUMERATOR) };
// The module's enums() (bind/enums.cc) builds Python's table from the same lists, so the two
// cannot drift apart.
#pragma once

#define JAX_UB_ENUMERATOR(name, text, value) name = value,
