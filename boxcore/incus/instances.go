package incus

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"
)

// Instance is an Incus instance (container or virtual machine).
type Instance struct {
	Name            string                       `json:"name"`
	Type            string                       `json:"type"` // "container" | "virtual-machine"
	Status          string                       `json:"status"`
	StatusCode      int                          `json:"status_code"`
	Description     string                       `json:"description"`
	Config          map[string]string            `json:"config"`
	Devices         map[string]map[string]string `json:"devices"`
	ExpandedConfig  map[string]string            `json:"expanded_config"`
	ExpandedDevices map[string]map[string]string `json:"expanded_devices"`
	Profiles        []string                     `json:"profiles"`
	Ephemeral       bool                         `json:"ephemeral"`
	Stateful        bool                         `json:"stateful"`
	CreatedAt       time.Time                    `json:"created_at"`
	LastUsedAt      time.Time                    `json:"last_used_at"`
	Architecture    string                       `json:"architecture"`
	Location        string                       `json:"location"`
	Project         string                       `json:"project"`

	// State and Snapshots are filled by Instances(..., full=true) only.
	State     *InstanceState `json:"state,omitempty"`
	Snapshots []Snapshot     `json:"snapshots,omitempty"`
}

// InstanceState is the runtime state of an instance (/1.0/instances/<n>/state).
type InstanceState struct {
	Status     string                  `json:"status"`
	StatusCode int                     `json:"status_code"`
	Pid        int64                   `json:"pid"`
	Processes  int64                   `json:"processes"`
	Network    map[string]NetworkState `json:"network"`
	StartedAt  time.Time               `json:"started_at"`
}

// NetworkState is one interface of an instance's state.
type NetworkState struct {
	Addresses []NetworkAddress `json:"addresses"`
	Hwaddr    string           `json:"hwaddr"`
	HostName  string           `json:"host_name"`
	Mtu       int              `json:"mtu"`
	State     string           `json:"state"`
	Type      string           `json:"type"`
}

// NetworkAddress is one address of an interface.
type NetworkAddress struct {
	Family  string `json:"family"` // "inet" | "inet6"
	Address string `json:"address"`
	Netmask string `json:"netmask"`
	Scope   string `json:"scope"` // "global" | "link" | "local"
}

// Snapshot is an instance snapshot. Name is the snapshot's own name (without "inst/").
type Snapshot struct {
	Name      string            `json:"name"`
	CreatedAt time.Time         `json:"created_at"`
	Stateful  bool              `json:"stateful"`
	Config    map[string]string `json:"config"`
	ExpiresAt time.Time         `json:"expires_at"`
	// Devices and Profiles are the snapshot's own (a clone of the snapshot gets these,
	// not the live instance's).
	Devices  map[string]map[string]string `json:"devices"`
	Profiles []string                     `json:"profiles"`
}

// InstanceSource says what a new instance is made from.
type InstanceSource struct {
	Type         string `json:"type"` // "image" | "copy" | "none"
	Alias        string `json:"alias,omitempty"`
	Fingerprint  string `json:"fingerprint,omitempty"`
	Server       string `json:"server,omitempty"`
	Protocol     string `json:"protocol,omitempty"` // "simplestreams" | "incus"
	Source       string `json:"source,omitempty"`   // copy: "inst" or "inst/snap"
	InstanceOnly bool   `json:"instance_only,omitempty"`
	Mode         string `json:"mode,omitempty"` // "pull"
}

// InstancesPost is the body of POST /1.0/instances.
type InstancesPost struct {
	Name        string                       `json:"name"`
	Type        string                       `json:"type,omitempty"`
	Profiles    []string                     `json:"profiles"`
	Config      map[string]string            `json:"config,omitempty"`
	Devices     map[string]map[string]string `json:"devices,omitempty"`
	Source      InstanceSource               `json:"source"`
	Start       bool                         `json:"start,omitempty"`
	Description string                       `json:"description,omitempty"`
	Ephemeral   bool                         `json:"ephemeral,omitempty"`
	// Architecture: a copy to another cluster member is a migration, which needs it said.
	Architecture string `json:"architecture,omitempty"`
	// Target, on a cluster, is the member to create it on (the ?target= parameter).
	Target string `json:"-"`
}

// createPath is where a create request goes: with ?target= when it names a member.
func (r InstancesPost) createPath() string {
	return memberPath("/1.0/instances", r.Target)
}

// InstancePut is the body of PUT /1.0/instances/<n>: the whole writable configuration.
type InstancePut struct {
	Config       map[string]string            `json:"config"`
	Devices      map[string]map[string]string `json:"devices"`
	Profiles     []string                     `json:"profiles"`
	Description  string                       `json:"description"`
	Ephemeral    bool                         `json:"ephemeral"`
	Architecture string                       `json:"architecture,omitempty"`
	Stateful     bool                         `json:"stateful"`
}

// Writable returns the PUT form of an instance, to modify and pass to UpdateInstance.
func (i Instance) Writable() InstancePut {
	return InstancePut{
		Config: i.Config, Devices: i.Devices, Profiles: i.Profiles, Description: i.Description,
		Ephemeral: i.Ephemeral, Architecture: i.Architecture, Stateful: i.Stateful,
	}
}

// FilterExpr renders a config filter as Incus's API filter expression, e.g.
// {"user.claudebox": "1"} → `config.user.claudebox eq 1`. Keys are sorted; clauses are
// joined with "and". Values with spaces are quoted.
func FilterExpr(configFilter map[string]string) string {
	keys := make([]string, 0, len(configFilter))
	for k := range configFilter {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		v := configFilter[k]
		if v == "" || strings.ContainsAny(v, " \t") {
			v = `"` + strings.ReplaceAll(v, `"`, `\"`) + `"`
		}
		parts = append(parts, "config."+k+" eq "+v)
	}
	return strings.Join(parts, " and ")
}

// Instances lists instances in one request (recursion=2 when full, so State and Snapshots
// are filled; recursion=1 otherwise), filtered server-side by configFilter (exact matches
// of config keys; nil means all).
func (c *Client) Instances(ctx context.Context, configFilter map[string]string, full bool) ([]Instance, error) {
	q := url.Values{}
	if full {
		q.Set("recursion", "2")
	} else {
		q.Set("recursion", "1")
	}
	if len(configFilter) > 0 {
		q.Set("filter", FilterExpr(configFilter))
	}
	var out []Instance
	if _, err := c.get(ctx, "/1.0/instances?"+q.Encode(), &out); err != nil {
		return nil, err
	}
	return out, nil
}

// Instance returns one instance and its ETag.
func (c *Client) Instance(ctx context.Context, name string) (Instance, string, error) {
	var out Instance
	etag, err := c.get(ctx, "/1.0/instances/"+esc(name), &out)
	return out, etag, err
}

// InstanceState returns the runtime state of an instance.
func (c *Client) InstanceState(ctx context.Context, name string) (InstanceState, error) {
	var out InstanceState
	_, err := c.get(ctx, "/1.0/instances/"+esc(name)+"/state", &out)
	return out, err
}

// CreateInstance creates an instance and waits for it (and for its start, when req.Start).
// progress, when not nil, receives the operation's progress metadata (image download and
// unpack percentages) while waiting.
func (c *Client) CreateInstance(ctx context.Context, req InstancesPost, progress func(ProgressEvent)) error {
	if req.Profiles == nil {
		req.Profiles = []string{}
	}
	id, err := c.start(ctx, http.MethodPost, req.createPath(), req, nil)
	if err != nil || id == "" {
		return err
	}
	_, err = c.WaitOperation(ctx, id, progress)
	return err
}

// StartCreateInstance sends the create request and returns its operation id without
// waiting, so a caller can wait for, cancel, or outlive the operation (WaitOperation,
// CancelOperation). An empty id means the daemon answered synchronously: it is done.
func (c *Client) StartCreateInstance(ctx context.Context, req InstancesPost) (string, error) {
	if req.Profiles == nil {
		req.Profiles = []string{}
	}
	return c.start(ctx, http.MethodPost, req.createPath(), req, nil)
}

// UpdateInstance replaces an instance's writable configuration (PUT). etag, when not
// empty, makes the update conditional (412 when the instance changed meanwhile).
func (c *Client) UpdateInstance(ctx context.Context, name string, put InstancePut, etag string) error {
	if put.Profiles == nil {
		put.Profiles = []string{}
	}
	_, err := c.call(ctx, http.MethodPut, "/1.0/instances/"+esc(name), put, &reqOpts{etag: etag})
	return err
}

// UnsetInstanceConfig removes config keys from an instance in one synchronous request
// (PATCH: Incus deletes a key given an empty value), conditional on etag when not empty.
func (c *Client) UnsetInstanceConfig(ctx context.Context, name string, keys []string, etag string) error {
	cfg := map[string]string{}
	for _, k := range keys {
		cfg[k] = ""
	}
	_, err := c.call(ctx, http.MethodPatch, "/1.0/instances/"+esc(name), map[string]any{"config": cfg}, &reqOpts{etag: etag})
	return err
}

// RestoreSnapshot restores an instance to one of its snapshots.
func (c *Client) RestoreSnapshot(ctx context.Context, name, snap string) error {
	_, err := c.call(ctx, http.MethodPut, "/1.0/instances/"+esc(name), map[string]any{"restore": snap}, nil)
	return err
}

// DeleteInstance deletes an instance (it must be stopped; see SetState).
func (c *Client) DeleteInstance(ctx context.Context, name string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/instances/"+esc(name), nil, nil)
	return err
}

// SetState starts, stops, restarts, freezes or unfreezes an instance and waits for it.
// force kills instead of a clean shutdown (stop/restart); timeout bounds a clean shutdown
// (0 lets the daemon choose; negative waits forever).
func (c *Client) SetState(ctx context.Context, name, action string, force bool, timeout time.Duration) error {
	switch action {
	case "start", "stop", "restart", "freeze", "unfreeze":
	default:
		return fmt.Errorf("incus: unknown state action %q", action)
	}
	body := map[string]any{"action": action, "force": force}
	switch {
	case timeout < 0:
		body["timeout"] = -1
	case timeout > 0:
		s := int(timeout / time.Second)
		if s == 0 {
			s = 1
		}
		body["timeout"] = s
	}
	_, err := c.call(ctx, http.MethodPut, "/1.0/instances/"+esc(name)+"/state", body, nil)
	return err
}

// RenameInstance renames a stopped instance. The daemon refuses to rename a running one.
func (c *Client) RenameInstance(ctx context.Context, name, newName string) error {
	_, err := c.call(ctx, http.MethodPost, "/1.0/instances/"+esc(name), map[string]any{"name": newName}, nil)
	return err
}

// CreateSnapshot takes a (stateless) snapshot of an instance.
func (c *Client) CreateSnapshot(ctx context.Context, inst, snap string) error {
	_, err := c.call(ctx, http.MethodPost, "/1.0/instances/"+esc(inst)+"/snapshots",
		map[string]any{"name": snap, "stateful": false}, nil)
	return err
}

// Snapshots lists an instance's snapshots.
func (c *Client) Snapshots(ctx context.Context, inst string) ([]Snapshot, error) {
	var out []Snapshot
	if _, err := c.get(ctx, "/1.0/instances/"+esc(inst)+"/snapshots?recursion=1", &out); err != nil {
		return nil, err
	}
	for i := range out {
		out[i].Name = snapName(out[i].Name)
	}
	return out, nil
}

// DeleteSnapshot deletes one snapshot of an instance.
func (c *Client) DeleteSnapshot(ctx context.Context, inst, snap string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/instances/"+esc(inst)+"/snapshots/"+esc(snap), nil, nil)
	return err
}

// snapName strips an "inst/" prefix some daemons put on snapshot names.
func snapName(n string) string {
	if i := strings.LastIndexByte(n, '/'); i >= 0 {
		return n[i+1:]
	}
	return n
}
