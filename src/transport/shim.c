/* Constants that rsmpi's mpi-sys does not export. Their values are
 * implementation-defined (Open MPI: (void*)1, MPICH: (void*)-1), so they are read
 * from the real header here instead of being guessed in Rust. */
#include <mpi.h>

void *kolo_mpi_in_place(void) { return MPI_IN_PLACE; }
