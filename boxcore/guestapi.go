package boxcore

import (
	"context"
	"fmt"
	"maps"
	"os"
)

// KeyGuestAPI controls /dev/incus, the API a box has to its own instance. claudebox turns it
// off on the profile (ProfileConfig); a box overriding it is drift, and off the clone boundary
// (security.* is never claudebox's on a box).
const KeyGuestAPI = "security.guestapi"

// guestAPIIn reads, from the host, whether /dev/incus exists in a running box: through the
// root of its init process, what the box itself sees.
func (h *Host) guestAPIIn(ctx context.Context, box string) bool {
	st, err := h.Client.InstanceState(ctx, box)
	if err != nil || st.Pid <= 0 {
		return false
	}
	_, err = os.Lstat(fmt.Sprintf("/proc/%d/root/dev/incus", st.Pid))
	return err == nil
}

// guestAPIOn overrides the profile on each of the hole's boxes (Incus adds /dev/incus to a
// running container at once); restore removes the override.
func (sw *switcher) guestAPIOn(ctx context.Context) error {
	for _, b := range sw.boxes {
		in, etag, err := sw.h.Client.Instance(ctx, b)
		if err != nil {
			return err
		}
		put := in.Writable()
		put.Config = maps.Clone(in.Config)
		if put.Config == nil {
			put.Config = map[string]string{}
		}
		put.Config[KeyGuestAPI] = "true"
		if err := sw.h.Client.UpdateInstance(ctx, b, put, etag); err != nil {
			return fmt.Errorf("box %s: %w", b, err)
		}
		sw.guestAPI = append(sw.guestAPI, b)
	}
	return nil
}

func (sw *switcher) restoreGuestAPI(ctx context.Context, box string) error {
	in, etag, err := sw.h.Client.Instance(ctx, box)
	if err != nil {
		return err
	}
	put := in.Writable()
	put.Config = maps.Clone(in.Config)
	delete(put.Config, KeyGuestAPI)
	return sw.h.Client.UpdateInstance(ctx, box, put, etag)
}
