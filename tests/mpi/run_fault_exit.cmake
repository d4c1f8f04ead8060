# Runs the fault_exit program under mpiexec and checks that the job ends by itself, with a non-zero
# status, well within LIMIT seconds, after rank 2 announced its exit.
# -DMPIEXEC=... -DNP=4 -DPROGRAM=... -DLIMIT=90 -DFLAGS="extra mpiexec flags"
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
string(TIMESTAMP start "%s")
execute_process(COMMAND "${MPIEXEC}" -n ${NP} ${flags} "${PROGRAM}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${LIMIT})
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message(STATUS "mpiexec ended after ${seconds} s with '${rc}'")
message(STATUS "output:\n${out}\n${err}")
if(rc MATCHES "timeout" OR seconds GREATER_EQUAL ${LIMIT})
  message(FATAL_ERROR "the job did not end within ${LIMIT} s: a rank's exit left its peers hanging")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job exited 0 although rank 2 died")
endif()
if(NOT out MATCHES "rank 2 exits at step 2")
  message(FATAL_ERROR "rank 2 never reached its exit")
endif()
if(out MATCHES "finished all steps")
  message(FATAL_ERROR "a rank finished all steps without its peer")
endif()
