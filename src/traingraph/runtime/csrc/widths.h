/* The header named by LANES_BODY compiled once per vector width (included where that header's
 * loops are wanted; the includer defines LANES_BODY and undefines it after):
 *
 *   V, VI, VU  the float vector, the int vector of as many lanes, the float vector read and
 *              written at any float's alignment,
 *   LANES      its lanes,
 *   FN(name)   the name of each generated function: name_16 and name_8.
 *
 * The 16-lane loops fill an AVX-512 register; the 8-lane ones are for narrow_blocks (without
 * AVX-512, GCC compiles 64-byte vectors into poor AVX2 code: comparisons lane by lane). */

#define V v16
#define VI v16i
#define VU v16u
#define LANES 16
#define FN(name) name##_16
#include LANES_BODY
#undef V
#undef VI
#undef VU
#undef LANES
#undef FN

#define V v8
#define VI v8i
#define VU v8u
#define LANES 8
#define FN(name) name##_8
#include LANES_BODY
#undef V
#undef VI
#undef VU
#undef LANES
#undef FN
