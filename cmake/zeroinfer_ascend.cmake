# The AscendC kernels need Huawei's CANN toolkit (the bisheng compiler and ASCEND_HOME_PATH).
# CANN is not on PyPI or Debian, so on most machines, CI included, this resolves to OFF and the
# build says so. Result: ZEROINFER_WITH_ASCEND (ON/OFF).
set(ZEROINFER_WITH_ASCEND OFF)
set(_zi_ascend_home "$ENV{ASCEND_HOME_PATH}")
find_program(ZI_BISHENG bisheng HINTS "${_zi_ascend_home}/compiler/ccec_compiler/bin")
if(_zi_ascend_home AND ZI_BISHENG)
  set(ZEROINFER_WITH_ASCEND ON)
else()
  message(STATUS "zeroinfer: CANN toolkit not found (ASCEND_HOME_PATH + bisheng); "
                 "the AscendC kernels in ascend/ are not built")
endif()
