/* mpi_bench: the anchor ferrogloo-bench is compared with, timed by the same rule.
 *
 *   mpirun -np N mpi_bench LABEL OPS SIZES SECONDS
 *
 * LABEL names the run in the JSON rows ("openmpi-tcp", "openmpi-shm", "mpich"); OPS is a
 * comma-separated list of allreduce, allgather, broadcast, reduce_scatter, alltoall; SIZES
 * are bytes (the total a call moves, nccl-tests' convention: allgather's output, the others'
 * input); SECONDS is the time spent per cell (at least 5 timed calls).
 *
 * Every call is timed on its own: a barrier, the buffer's reset, a barrier, the call; the
 * iteration's time is the slowest rank's. f32 elements, sum. Rank 0 prints one JSON object
 * per cell, with the fields ferrogloo-bench's --json rows have. Results are checked. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIN_ITERS 5
#define MAX_ITERS 100000
#define WARMUP 3

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fill(float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

/* Whether every one of n elements of p equals v (small integers: exact in any order). */
static int all(const float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

struct cell {
    const char *op;
    size_t bytes;      /* asked for */
    size_t in, out;    /* elements of the input and output buffers */
    double factor;     /* busbw = algbw * factor */
};

static int plan(struct cell *c, int n) {
    size_t count = c->bytes / sizeof(float);
    size_t per = count / (size_t)n;
    if (!strcmp(c->op, "allreduce") || !strcmp(c->op, "broadcast")) {
        c->in = c->out = count;
        c->factor = !strcmp(c->op, "allreduce") ? 2.0 * (n - 1) / n : 1.0;
    } else if (!strcmp(c->op, "allgather")) {
        c->in = per, c->out = per * n, c->factor = (double)(n - 1) / n;
    } else if (!strcmp(c->op, "reduce_scatter")) {
        c->in = per * n, c->out = per, c->factor = (double)(n - 1) / n;
    } else if (!strcmp(c->op, "alltoall")) {
        c->in = c->out = per * n, c->factor = (double)(n - 1) / n;
    } else {
        return -1;
    }
    return 0;
}

/* One call of the cell's collective, in place where the collective allows. */
static void call(const struct cell *c, float *in, float *out, int n) {
    if (!strcmp(c->op, "allreduce"))
        MPI_Allreduce(MPI_IN_PLACE, in, (int)c->in, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(c->op, "broadcast"))
        MPI_Bcast(in, (int)c->in, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else if (!strcmp(c->op, "allgather"))
        MPI_Allgather(in, (int)c->in, MPI_FLOAT, out, (int)c->in, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(c->op, "reduce_scatter"))
        MPI_Reduce_scatter_block(in, out, (int)c->out, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else
        MPI_Alltoall(in, (int)(c->in / n), MPI_FLOAT, out, (int)(c->in / n), MPI_FLOAT, MPI_COMM_WORLD);
}

/* The input every call starts from: rank r's value r + 1 (0 on broadcast's other ranks). */
static void reset(const struct cell *c, float *in, int r) {
    fill(in, c->in, (!strcmp(c->op, "broadcast") && r != 0) ? 0.0f : (float)(r + 1));
}

/* Whether the last call's result is right on this rank. */
static int right(const struct cell *c, const float *in, const float *out, int r, int n) {
    float sum = (float)n * (n + 1) / 2;
    if (!strcmp(c->op, "allreduce")) return all(in, c->in, sum);
    if (!strcmp(c->op, "broadcast")) return all(in, c->in, 1.0f);
    if (!strcmp(c->op, "reduce_scatter")) return all(out, c->out, sum);
    size_t per = !strcmp(c->op, "allgather") ? c->in : c->in / n;
    for (int p = 0; p < n; p++)
        if (!all(out + (size_t)p * per, per, (float)(p + 1))) return 0;
    (void)r;
    return 1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int r, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc != 5) {
        if (r == 0) fprintf(stderr, "usage: mpi_bench LABEL OPS SIZES SECONDS\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *label = argv[1];
    double seconds = atof(argv[4]);
    double *times = malloc(sizeof(double) * MAX_ITERS);
    char *ops = strdup(argv[2]), *save_op = NULL;
    for (char *op = strtok_r(ops, ",", &save_op); op; op = strtok_r(NULL, ",", &save_op)) {
        char *sizes = strdup(argv[3]), *save_size = NULL;
        for (char *sz = strtok_r(sizes, ",", &save_size); sz; sz = strtok_r(NULL, ",", &save_size)) {
            struct cell c = {op, strtoull(sz, NULL, 10), 0, 0, 0};
            if (plan(&c, n)) {
                if (r == 0) fprintf(stderr, "mpi_bench: unknown collective %s\n", op);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
            float *in = malloc(sizeof(float) * (c.in ? c.in : 1));
            float *out = malloc(sizeof(float) * (c.out ? c.out : 1));
            for (int w = 0; w < WARMUP; w++) {
                reset(&c, in, r);
                call(&c, in, out, n);
            }
            int iters = 0;
            double until = MPI_Wtime() + seconds;
            for (;;) {
                /* Rank 0 decides whether another call fits, so every rank makes as many. */
                int more = iters < MAX_ITERS && (iters < MIN_ITERS || MPI_Wtime() < until);
                MPI_Bcast(&more, 1, MPI_INT, 0, MPI_COMM_WORLD);
                if (!more) break;
                MPI_Barrier(MPI_COMM_WORLD);
                reset(&c, in, r);
                MPI_Barrier(MPI_COMM_WORLD);
                double t = MPI_Wtime();
                call(&c, in, out, n);
                times[iters++] = (MPI_Wtime() - t) * 1e6;
            }
            int wrong = !right(&c, in, out, r, n), any_wrong = 0;
            MPI_Allreduce(&wrong, &any_wrong, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
            MPI_Allreduce(MPI_IN_PLACE, times, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (r == 0) {
                qsort(times, (size_t)iters, sizeof(double), cmp_double);
                double p50 = times[iters / 2];
                size_t moved = (c.in > c.out ? c.in : c.out) * sizeof(float);
                double algbw = p50 > 0 ? moved / p50 / 1e3 : 0;
                printf("{\"impl\": \"%s\", \"op\": \"%s\", \"ranks\": %d, \"bytes\": %zu, \"dtype\": \"f32\", "
                       "\"iters\": %d, \"p50_us\": %.3f, \"min_us\": %.3f, \"p99_us\": %.3f, "
                       "\"algbw_gbps\": %.4f, \"busbw_gbps\": %.4f, \"wrong\": %d, \"timing\": \"per-call-barrier\"}\n",
                       label, c.op, n, moved, iters, p50, times[0], times[(int)((iters - 1) * 0.99)], algbw,
                       algbw * c.factor, any_wrong);
                fflush(stdout);
            }
            free(in);
            free(out);
        }
        free(sizes);
    }
    free(ops);
    free(times);
    MPI_Finalize();
    return 0;
}
