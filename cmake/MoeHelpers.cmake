# moe_cc_library(NAME name ALIAS moe::name SRCS ... [CUDA_SRCS ...] PUBLIC_DEPS ... PRIVATE_DEPS ...
#                [INCLUDE_DIR dir])
function(moe_cc_library)
  cmake_parse_arguments(A "" "NAME;ALIAS;INCLUDE_DIR" "SRCS;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS})
  if(A_ALIAS)
    add_library(${A_ALIAS} ALIAS ${A_NAME})
  endif()
  if(A_INCLUDE_DIR)
    target_include_directories(${A_NAME} PUBLIC ${A_INCLUDE_DIR})
  endif()
  target_link_libraries(${A_NAME} PUBLIC ${A_PUBLIC_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  set_target_properties(${A_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

# moe_cc_test(NAME name SRCS ... DEPS ... [LABELS ...] [TIMEOUT s] [TEST_PREFIX p])
# A GoogleTest binary registered with CTest, one CTest entry per test case (named p + the case,
# so that `ctest -R p` picks the binary's cases).
function(moe_cc_test)
  if(NOT MOE_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(A "" "NAME;TIMEOUT;TEST_PREFIX" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_definitions(${A_NAME} PRIVATE
    MOE_TESTDATA_DIR="${MOE_TESTDATA_DIR}"
    MOE_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
    MOE_BINARY_DIR="${CMAKE_BINARY_DIR}")
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set(labels ${A_LABELS})
  if(NOT labels)
    set(labels cpu)
  endif()
  gtest_discover_tests(${A_NAME}
    TEST_PREFIX "${A_TEST_PREFIX}"
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${labels}" TIMEOUT ${A_TIMEOUT})
endfunction()
include(GoogleTest)
