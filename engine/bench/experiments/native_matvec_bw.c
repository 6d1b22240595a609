/* The native step's matrix-vector products alone at batch 1, out of cache: 28 layers of a
   Qwen2.5-1.5B-shaped gate|up (2 x 8960 x 1536) and down (1536 x 8960), Q4_1 (or down as Q8_0),
   in the step's own OpenMP team; prints the weight bytes read per second.
   Build and run from the repository root (SRC: the C source under test):
     gcc -O3 -march=native -fopenmp -I. -DSRC='"engine/kernels/native_decode.c"' \
         engine/bench/experiments/native_matvec_bw.c -o /tmp/mv -lm
     /tmp/mv THREADS [DOWN_Q8_0 [down-only]] */
#include SRC
#include <stdio.h>
/* 28 layers of gate_up (Q4_1 2x8960x1536) + down (1536x8960 Q4_1): ~940 MB, out of cache */
#define NL 28
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), q8 = argc > 2 ? atoi(argv[2]) : 0;
    const int I = 8960, H = 1536;
    fused_t gu[NL], dn[NL];
    for (int l = 0; l < NL; l++) {
        for (int p = 0; p < 2; p++) {
            matrix_t *w = &gu[l].part[p];
            w->type = Q4_1; w->n = I; w->k = H;
            w->qs = malloc((size_t)I * H / 2); memset((void *)w->qs, 0x35 + l, (size_t)I * H / 2);
            float *d = malloc(sizeof(float) * I * H / 32), *m = malloc(sizeof(float) * I * H / 32);
            for (size_t i = 0; i < (size_t)I * H / 32; i++) d[i] = 0.01f, m[i] = -0.02f;
            w->d = d; w->m = m;
        }
        gu[l].parts = 2;
        matrix_t *w = &dn[l].part[0];
        w->type = q8 ? Q8_0 : Q4_1; w->n = H; w->k = I;
        w->qs = malloc((size_t)I * H / (q8 ? 1 : 2)); memset((void *)w->qs, 0x17 + l, (size_t)I * H / (q8 ? 1 : 2));
        float *d = malloc(sizeof(float) * I * H / 32), *m = malloc(sizeof(float) * I * H / 32);
        for (size_t i = 0; i < (size_t)I * H / 32; i++) d[i] = 0.01f, m[i] = -0.02f;
        w->d = d; w->m = m; dn[l].parts = 1;
    }
    float *x = malloc(sizeof(float) * I), *y = malloc(sizeof(float) * 2 * I);
    for (int i = 0; i < I; i++) x[i] = sinf(i);
    qact_t a1 = {malloc(H), malloc(4 * H / 32), malloc(4 * H / 32), calloc(8 * H / 32, 4), calloc(8 * H / 32, 4), 0, 8};
    qact_t a2 = {malloc(I), malloc(4 * I / 32), malloc(4 * I / 32), calloc(8 * I / 32, 4), calloc(8 * I / 32, 4), 0, 8};
    quantize_rows(x, 1, H, &a1); quantize_rows(x, 1, I, &a2);
    double bytes = NL * ((double)I * H / 2 * 2 + (double)I * H / 32 * 8 * 2 + (double)I * H / (q8 ? 1 : 2) + (double)I * H / 32 * (q8 ? 4 : 8));
    int only_down = argc > 3;
    double best = 1e9, sum = 0;
    for (int rep = 0; rep < 6; rep++) {
        double t = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        for (int l = 0; l < NL; l++) { if (!only_down) matvec(&gu[l], &a1, 1, y, 1); matvec(&dn[l], &a2, 1, y, 1); }
        t = omp_get_wtime() - t; if (rep) sum += t; if (t < best) best = t;
    }
    if (only_down) bytes = NL * ((double)I * H / (q8 ? 1 : 2) + (double)I * H / 32 * (q8 ? 4 : 8));
    printf("%s threads %d q8 %d down-only %d: best %.2f GB/s mean %.2f GB/s  y0 %g\n", SRC, threads, q8, only_down, bytes / best / 1e9, bytes / (sum / 5) / 1e9, y[0]);
}
