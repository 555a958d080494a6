#pragma once

namespace cake {

// Element types crossing the binding -> launcher boundary; kernel files include
// no torch header, so tensors arrive as raw pointers plus one of these tags.
enum class DType : int { kFloat32, kFloat16, kBFloat16 };

}  // namespace cake
