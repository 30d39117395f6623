# qkv_layer(NAME [SEPARATE] [DEPENDS lower layers...] [LIBRARIES third-party targets...])
#
# One layer of the library (docs/architecture.md) as an object library qkv_NAME built from the
# sources in the calling folder (src/NAME). Its compiler sees only its own public headers
# (include/qkv/NAME), those of the layers it DEPENDS on, and its private headers in src/NAME: an
# #include of a header from any other layer fails to compile. That works through a per-layer
# include root in the build tree, layers/NAME/qkv/NAME, a link to include/qkv/NAME. A SEPARATE
# layer is left out of libqkv (qkv_link_layers): dist, whose MPI a user of libqkv need not have.
function(qkv_layer name)
  cmake_parse_arguments(LAYER "SEPARATE" "" "DEPENDS;LIBRARIES" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  add_library(qkv_${name} OBJECT ${sources})
  if(NOT LAYER_SEPARATE)
    set_property(GLOBAL APPEND PROPERTY QKV_LAYERS ${name})
  endif()
  set(root ${PROJECT_BINARY_DIR}/layers/${name})
  file(MAKE_DIRECTORY ${root}/qkv)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/qkv/${name} ${root}/qkv/${name} SYMBOLIC)
  target_include_directories(qkv_${name} PUBLIC $<BUILD_INTERFACE:${root}> PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  foreach(lower ${LAYER_DEPENDS})
    target_link_libraries(qkv_${name} PUBLIC qkv_${lower})
  endforeach()
  target_link_libraries(qkv_${name} PRIVATE ${LAYER_LIBRARIES})
  target_compile_features(qkv_${name} PUBLIC cxx_std_20)
  target_compile_options(qkv_${name} PRIVATE ${QKV_WARNINGS})
  # Every multiply and add rounds as written; a fused multiply-add happens only where a kernel asks
  # for one (hn::MulAdd). GCC would otherwise fuse a Mul and a Sub in the targets that have FMA
  # (AVX2, AVX-512) and not in the others, so a score would round one way where the forward takes
  # exp(scale·x − m) and another where the backward forms s = scale·x first: at large logits that
  # difference is an ulp of |s| in every P, and it would differ between instruction sets.
  target_compile_options(qkv_${name} PRIVATE -ffp-contract=off)
  # One set of Highway targets for every kernel and for src/core/simd_target.cpp, which names them.
  # SSSE3-only CPUs are rare enough not to be worth the compile time; they run the portable build.
  target_compile_definitions(qkv_${name} PRIVATE HWY_DISABLED_TARGETS=HWY_SSSE3)
  set_target_properties(qkv_${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

# qkv_link_layers(TARGET): links the objects of every layer declared so far into TARGET, with what
# they need (their include roots, fmt, Highway, OpenMP, cairo, ...). libqkv is made so, and so is
# the Python module, which carries the library inside it: an installed package needs no libqkv.
function(qkv_link_layers target)
  get_property(layers GLOBAL PROPERTY QKV_LAYERS)
  foreach(layer ${layers})
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:qkv_${layer}>)
    target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:qkv_${layer}>)
  endforeach()
endfunction()
