/* LD_PRELOAD shim for prterun --dvm in PRRTE 3.0.14 (openpmix/prrte #2364): prun_common()
 * iterates prte_ess_base_signals, a pmix_list_t that is only constructed when the ess framework
 * opens, which the --dvm (tool) path never does. Construct it before main(). */
#include <string.h>
#include <stddef.h>
typedef void (*ctor_t)(void *);
struct cls { const char *name; void *parent; ctor_t c, d; int init, depth; ctor_t *carr, *darr; size_t size; };
extern struct cls pmix_list_t_class __attribute__((weak));
extern char prte_ess_base_signals[] __attribute__((weak));
extern void pmix_class_initialize(struct cls *) __attribute__((weak));
__attribute__((constructor)) static void fix(void) {
    struct cls *k = &pmix_list_t_class;
    if (!prte_ess_base_signals || !k || !pmix_class_initialize) return;   /* not prterun */
    pmix_class_initialize(k);
    memset(prte_ess_base_signals, 0, k->size);
    *(struct cls **)prte_ess_base_signals = k;                 /* obj_class */
    *(int *)(prte_ess_base_signals + sizeof(void *)) = 1;       /* obj_reference_count */
    for (ctor_t *c = k->carr; c && *c; ++c) (*c)(prte_ess_base_signals);
}
