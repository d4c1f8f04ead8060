# Copies qcoll's CUDA sources into the emulation build tree, rewriting what a host compiler cannot
# read (run as `cmake -P`, see tests/emu/CMakeLists.txt):
#   - every kernel launch `k<<<cfg>>>(args)` becomes `k << ::qcoll_emu::LaunchConfig(__FILE__,
#     __LINE__, cfg)(args)` (tests/emu/include/cuda_runtime.h performs it);
#   - the one inline PTX statement qcoll has, the %globaltimer read of cuda_local.cuh, becomes a
#     call of the emulator's clock. Any other inline asm stops the build.
# A `#line 1 "<source>"` first line keeps compiler messages and __FILE__ on the original files;
# the rewrite never changes the line count. Outputs are written only when their content changes.
#
# Variables: SRC_ROOT, DST_ROOT (directories), LIST (a file naming one path relative to SRC_ROOT
# per line).

cmake_minimum_required(VERSION 3.25)

file(STRINGS "${LIST}" files)
foreach(rel IN LISTS files)
  set(src "${SRC_ROOT}/${rel}")
  set(dst "${DST_ROOT}/${rel}")
  file(READ "${src}" text)
  # Each `<<<` and the first `>>>` after it; a `>>>` that closes nested templates stays.
  set(out "")
  while(TRUE)
    string(FIND "${text}" "<<<" open)
    if(open EQUAL -1)
      break()
    endif()
    string(SUBSTRING "${text}" 0 ${open} head)
    math(EXPR after "${open} + 3")
    string(SUBSTRING "${text}" ${after} -1 text)
    string(FIND "${text}" ">>>" close)
    if(close EQUAL -1)
      message(FATAL_ERROR "qcoll-emu: ${src}: a `<<<` without its `>>>`")
    endif()
    string(SUBSTRING "${text}" 0 ${close} config)
    math(EXPR after "${close} + 3")
    string(SUBSTRING "${text}" ${after} -1 text)
    string(APPEND out "${head}<< ::qcoll_emu::LaunchConfig(__FILE__, __LINE__, ${config})")
  endwhile()
  set(text "${out}${text}")
  string(REGEX REPLACE
         "asm[ \t]+volatile[ \t]*\\([ \t]*\"mov\\.u64 %0, %%globaltimer;\"[ \t]*:[ \t]*\"=l\"\\(([A-Za-z_][A-Za-z0-9_]*)\\)[ \t]*\\)"
         "\\1 = ::qcoll_emu::global_timer_ns()" text "${text}")
  # An asm statement with an empty template emits no instruction (the host kernels use such
  # statements to keep constants in registers): the host compiler gives it its meaning unchanged.
  string(REGEX REPLACE "(asm|__asm__)[ \t]*(volatile[ \t]*)?\\([ \t]*\"\"" "empty_asm(" checked "${text}")
  # The host kernels' one x86 instruction (fused_mul_add's vfmadd213ps, in code that runs only
  # where the processor has FMA) is host code, which the emulation runs natively: unchanged too.
  string(REGEX REPLACE "(asm|__asm__)[ \t]*(volatile[ \t]*)?\\([ \t]*\"vfmadd213ps " "host_asm(" checked
         "${checked}")
  string(REGEX MATCH "[^A-Za-z0-9_](asm|__asm__)[ \t]*(volatile[ \t]*)?\\(" leftover "${checked}")
  if(leftover)
    message(FATAL_ERROR "qcoll-emu: ${src} holds inline assembly the CPU emulation cannot run "
                        "(${leftover}); teach tests/emu/rewrite.cmake its meaning")
  endif()
  string(REPLACE "\\" "/" line_name "${src}")
  set(text "#line 1 \"${line_name}\"\n${text}")
  # The #line directive shifts nothing: it names line 1 of the original for the copy's line 2.
  set(tmp "${dst}.tmp")
  file(WRITE "${tmp}" "${text}")
  file(COPY_FILE "${tmp}" "${dst}" ONLY_IF_DIFFERENT)
  file(REMOVE "${tmp}")
endforeach()
